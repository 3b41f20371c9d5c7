"""`python -m bench`: a short demo of what memopt saves for backward (the full harness replaces it)."""

import torch

import memopt


def main() -> None:
    rows = []
    x = torch.randn(4096, 1024, requires_grad=True)
    residual = torch.randn(4096, 1024, requires_grad=True)
    eager = memopt.saved_bytes(lambda a, b: torch.nn.functional.dropout(a, 0.1) + b, x, residual)
    fused = memopt.saved_bytes(memopt.dropout_add, x, residual, 0.1)
    rows.append(("dropout + residual add", eager, fused))
    print(f"memopt {memopt.__version__}, torch {torch.__version__}, build {memopt.build_info()}")
    print()
    print("| computation | eager saves (bytes) | memopt saves (bytes) |")
    print("|---|---:|---:|")
    for name, e, f in rows:
        print(f"| {name} (4096 x 1024 fp32) | {e:,} | {f:,} |")


if __name__ == "__main__":
    main()
