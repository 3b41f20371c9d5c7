"""memopt.Plan.from_dict validates at load (issue: 17 of 34 malformed dicts used to be accepted)."""

import copy
import json
import math

import pytest

import memopt
from memopt.plan import LayerCost


def _cost(none_bytes: int) -> LayerCost:
    choices = [("none", False), ("selective", False), ("full", False), ("none", True)]
    return LayerCost(
        device_bytes=dict(zip(choices, [none_bytes, none_bytes // 2, 0, 100])),
        host_bytes=dict(zip(choices, [0, 0, 0, none_bytes - 100])),
        seconds=dict(zip(choices, [0.0, 0.001, 0.002, 0.0015])),
    )


def _valid() -> dict:
    plan = memopt.Plan(
        layer_names=["layers.0", "layers.1"],
        choices=[("selective", False), ("full", False)],
        layer_costs=[_cost(4096), _cost(4096)],
        other_bytes=512,
        shared_bytes=64,
        budget_bytes=10_000,
    )
    return json.loads(json.dumps(plan.to_dict()))


def test_round_trip_of_a_valid_plan():
    data = _valid()
    plan = memopt.Plan.from_dict(data)
    assert plan.to_dict() == data
    assert plan.predicted_bytes == 512 + 64 + 2048 + 0


@pytest.mark.parametrize("loss", ["plain", "chunked", None])
def test_the_loss_round_trips(loss):
    data = {**_valid(), "loss": loss}
    plan = memopt.Plan.from_dict(data)
    assert plan.loss == loss and plan.to_dict() == data
    assert f"loss {loss or 'not recorded'}" in str(plan)


def test_data_saved_before_plans_recorded_their_loss_still_loads():
    data = _valid()
    del data["loss"]
    plan = memopt.Plan.from_dict(data)
    assert plan.loss is None
    assert plan.to_dict() == {**data, "loss": None}


def _set(path, value):
    def edit(data):
        target = data
        for key in path[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
    return edit


_DELETE = object()

MALFORMED = {
    "missing layer cost": (lambda d: d["layer_costs"].pop(), "layer costs"),
    "missing choice": (lambda d: d["choices"].pop(), "choices"),
    "extra layer name": (lambda d: d["layer_names"].append("layers.2"), "layers"),
    "duplicate layer names": (_set(["layer_names", 1], "layers.0"), "distinct"),
    "layer name not a string": (_set(["layer_names", 0], 3), "distinct"),
    "negative device bytes": (_set(["layer_costs", 0, 0, "device_bytes"], -1), "device_bytes"),
    "NaN device bytes": (_set(["layer_costs", 0, 1, "device_bytes"], math.nan), "device_bytes"),
    "string device bytes": (_set(["layer_costs", 0, 2, "device_bytes"], "12"), "device_bytes"),
    "float host bytes": (_set(["layer_costs", 1, 0, "host_bytes"], 1.5), "host_bytes"),
    "bool host bytes": (_set(["layer_costs", 1, 0, "host_bytes"], True), "host_bytes"),
    "negative seconds": (_set(["layer_costs", 0, 1, "seconds"], -0.1), "seconds"),
    "NaN seconds": (_set(["layer_costs", 0, 1, "seconds"], math.nan), "seconds"),
    "string seconds": (_set(["layer_costs", 0, 1, "seconds"], "fast"), "seconds"),
    "invented policy in a choice": (_set(["choices", 0, "policy"], "turbo"), "policy must be one of"),
    "policy 'offload'": (_set(["choices", 0, "policy"], "offload"), "offload is its own argument"),
    "offload not a bool": (_set(["choices", 0, "offload"], "yes"), r"\(policy, offload\) pair"),
    "invented policy in a cost row": (_set(["layer_costs", 0, 3, "policy"], "turbo"), "policy must be one of"),
    "duplicate cost row": (lambda d: d["layer_costs"][0].append(dict(d["layer_costs"][0][0])), "appears twice"),
    "cost row missing a key": (_set(["layer_costs", 0, 0, "seconds"], _DELETE), "exactly the keys"),
    "cost row with an extra key": (_set(["layer_costs", 0, 0, "speed"], 1), "exactly the keys"),
    "empty cost rows": (_set(["layer_costs", 1], []), "non-empty"),
    "choice not measured": (lambda d: d["layer_costs"][1].pop(2), "was not measured"),
    "choice not a dict": (_set(["choices", 0], ["selective", False]), "each choice"),
    "choice with an extra key": (_set(["choices", 0, "budget"], 1), "each choice"),
    "negative other bytes": (_set(["other_bytes"], -5), "other_bytes"),
    "string other bytes": (_set(["other_bytes"], "512"), "other_bytes"),
    "NaN shared bytes": (_set(["shared_bytes"], math.nan), "shared_bytes"),
    "negative budget": (_set(["budget_bytes"], -1), "budget_bytes"),
    "layer_names not a list": (_set(["layer_names"], "layers.0"), "layer_names must be a list"),
    "layer_costs not a list": (_set(["layer_costs"], {}), "layer_costs must be a list"),
    "missing key": (_set(["choices"], _DELETE), "lacks"),
    "unknown key": (_set(["policies"], []), "unknown keys"),
    "invented loss": (_set(["loss"], "fused"), "loss must be None or one of"),
    "loss not a string": (_set(["loss"], True), "loss must be None or one of"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_data_is_refused_at_load(case):
    edit, match = MALFORMED[case]
    data = copy.deepcopy(_valid())
    edit(data)
    with pytest.raises(ValueError, match=match):
        memopt.Plan.from_dict(data)
