// The activation offload engine: saved tensors go to host buffers on a side stream and come back
// ahead of need, one group (layer) at a time. memopt/offload.py drives it from
// torch.autograd.graph.saved_tensors_hooks and documents the Python API.
//
// Objects and their lifetimes:
// * HostBlock: one host buffer (pinned for CUDA sources) of a size class, owned by the pool and
//   lent to one Transfer at a time. Reused across steps: once warm, no host allocation per step.
// * Transfer: one device-to-host copy into one HostBlock, either of one storage or, coalesced, of
//   many small storages packed into one staging buffer (64-byte aligned segments). It belongs to
//   the group that was open when it was created and comes back to the device as one buffer.
// * StorageEntry: one saved storage (a segment of a Transfer). Saved views of one storage and a
//   tensor saved twice share it, so the storage is copied once.
// * Handle: one saved tensor (sizes, strides, offset, dtype and the version it was saved at).
//   Released by the Python side when autograd drops the saved tensor.
//
// Stream discipline (CUDA): the D2H copy runs on a per-device offload stream after an event
// recorded on the producing (current) stream; a coalesced transfer remembers every stream that was
// current when one of its storages was packed and waits on each when it is flushed. Sources are
// record_stream'ed onto the offload stream so the caching allocator cannot reuse them before the
// copy has read them. The H2D copy runs on a second stream after the D2H event and after an event
// on the current stream (the destination is allocated there and may reuse memory the current
// stream still reads); the consumer waits on the H2D event, and the destination is
// record_stream'ed onto the consumer's stream when that differs from the one it was allocated on.
// A host block returns to the pool with the event of its last copy, and is synchronised on before
// it is lent again. Nothing here can be captured in a CUDA graph (host waits, pinned allocations,
// side streams): every entry point refuses to run while the current stream is capturing.
//
// Failures: a pack whose copy fails leaves nothing behind (its transfer and budget are given
// back); a coalesced transfer whose flush fails stays registered but uncopied, and unpacking one
// of its tensors raises instead of restoring bytes that were never copied.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "common.h"

#ifdef MEMOPT_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

// CUDAEvent lives in at::cuda in older torch and in c10::cuda in newer; look in both.
namespace memopt_cuda_event_lookup {
using namespace at::cuda;
using namespace c10::cuda;
}  // namespace memopt_cuda_event_lookup
#endif

namespace memopt {
namespace {

constexpr const char* kOp = "offload";
constexpr int64_t kSegmentAlign = 64;  // every dtype's element size divides it
constexpr int64_t kMinSizeClass = 4096;

#ifdef MEMOPT_WITH_CUDA
using Event = memopt_cuda_event_lookup::CUDAEvent;
using EventPtr = std::shared_ptr<Event>;

EventPtr record_event(const c10::cuda::CUDAStream& stream, bool timing = false) {
  auto event = std::make_shared<Event>(timing ? cudaEventDefault : cudaEventDisableTiming);
  event->record(stream);
  return event;
}

// Host waits, pinned allocations and side-stream events cannot be captured: a capture would fail
// later with an obscure CUDA error, or replay copies into host blocks the pool has lent again.
void refuse_graph_capture(c10::DeviceIndex device, const char* what) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device).stream(), &status));
  MEMOPT_CHECK(status == cudaStreamCaptureStatusNone, kOp, what, ": the current stream of cuda:",
               static_cast<int>(device),
               " is capturing a CUDA graph; offload cannot run inside one (it waits on the host and "
               "copies through pooled pinned memory). Keep offloaded layers out of the captured region.");
}

// A pinned host buffer of exactly `nbytes`, freed when the tensor dies. Not from torch's caching
// host allocator: that one rounds every request up to a power of two (a 1.25 * 2^k block would
// pin 2^(k+1) bytes, up to 1.6x what max_host_bytes counted) and keeps the blocks the pool evicts
// pinned in its own cache. The pool here already caches; this way what it counts is what is pinned.
at::Tensor allocate_pinned(int64_t nbytes, c10::DeviceIndex device) {
  c10::cuda::CUDAGuard guard(device);  // a context must be current; the memory serves every device
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&ptr, static_cast<size_t>(nbytes), cudaHostAllocPortable));
  // cudaFreeHost waits for the device: blocks are freed only when the pool evicts one (after its
  // last copy was synchronised on) or with the engine.
  return at::from_blob(
      ptr, {nbytes}, [](void* p) { C10_CUDA_IGNORE_ERROR(cudaFreeHost(p)); },
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}
#endif

// Round up to 2^k * {1, 1.25, 1.5, 1.75}: at most 25% slack and few distinct classes, so a
// model's steps keep hitting the same pooled blocks.
int64_t size_class(int64_t nbytes) {
  if (nbytes <= kMinSizeClass) return kMinSizeClass;
  int64_t pow2 = 1;
  while (pow2 * 2 <= nbytes) pow2 *= 2;
  const int64_t step = pow2 / 4;
  return (nbytes + step - 1) / step * step;
}

int64_t align_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

// A 1-D uint8 tensor over the whole storage (its bytes, whatever the dtype of its views).
at::Tensor storage_bytes(const c10::Storage& storage) {
  const auto nbytes = static_cast<int64_t>(storage.nbytes());
  return at::empty({0}, at::TensorOptions().dtype(at::kByte).device(storage.device()))
      .set_(storage, 0, {nbytes}, {1});
}

struct HostBlock {
  at::Tensor buffer;  // uint8 [size_class]
  int64_t size_class = 0;
#ifdef MEMOPT_WITH_CUDA
  EventPtr last_use;  // the last copy that touches buffer; null when none is pending
#endif
};

// One storage waiting in a coalesced transfer: its bytes at pack time go to [byte_offset, +nbytes).
struct StagedPiece {
  c10::Storage source;
  int64_t byte_offset = 0;
  int64_t nbytes = 0;
};

struct Transfer {
  int64_t group = 0;
  c10::Device device = c10::Device(c10::kCPU);
  int64_t nbytes = 0;      // bytes used in the block
  int64_t reserved = 0;    // budget bytes held for it: size_class(nbytes), the block it is lent
  bool copied = false;     // D2H issued (false while staging, or when the flush failed)
  std::vector<StagedPiece> staged;  // until copied
  HostBlock block;
  at::Tensor restored;  // strong while prefetched and not every handle has been unpacked
  c10::weak_intrusive_ptr<c10::StorageImpl> restored_weak{c10::intrusive_ptr<c10::StorageImpl>()};
  int64_t live_handles = 0;
  int64_t pending_unpacks = 0;
#ifdef MEMOPT_WITH_CUDA
  EventPtr d2h_done;
  EventPtr h2d_done;
  std::vector<c10::cuda::CUDAStream> producers;  // streams current at the packs of staged storages
#endif
};

struct StorageEntry {
  int64_t transfer = -1;
  int64_t byte_offset = 0;
  int64_t nbytes = 0;
  // `key` is the source StorageImpl's address; `source` keeps that object (not its memory) alive
  // so the address cannot be reused by another storage while this entry is indexed by it.
  c10::StorageImpl* key = nullptr;
  c10::weak_intrusive_ptr<c10::StorageImpl> source{c10::intrusive_ptr<c10::StorageImpl>()};
  uint32_t version_at_copy = 0;
  int64_t live_handles = 0;
};

struct Handle {
  int64_t storage = -1;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t storage_offset = 0;
  at::ScalarType dtype = at::kFloat;
  c10::VariableVersion version_counter;
  uint32_t saved_version = 0;
  bool unpacked = false;
};

struct Group {
  std::vector<int64_t> transfers;
  bool backward_started = false;
  bool copies_out_finished = false;  // the host waited for every D2H copy of the group
};

class OffloadEngine : public torch::CustomClassHolder {
 public:
  OffloadEngine(int64_t max_host_bytes, bool pin_memory, bool allow_cpu_source, int64_t coalesce_bytes,
                int64_t staging_bytes, int64_t prefetch)
      : max_host_bytes_(max_host_bytes),
        pin_memory_(pin_memory),
        allow_cpu_source_(allow_cpu_source),
        coalesce_bytes_(coalesce_bytes),
        staging_bytes_(staging_bytes),
        prefetch_(prefetch) {
    MEMOPT_CHECK(max_host_bytes >= -1, kOp, "max_host_bytes must be >= 0 (or -1 for no limit), got ",
                 max_host_bytes);
    MEMOPT_CHECK(coalesce_bytes >= 0, kOp, "coalesce_bytes must be >= 0, got ", coalesce_bytes);
    MEMOPT_CHECK(staging_bytes >= coalesce_bytes, kOp, "staging_bytes must be >= coalesce_bytes (",
                 coalesce_bytes, "), got ", staging_bytes);
    MEMOPT_CHECK(prefetch >= 0, kOp, "prefetch must be >= 0, got ", prefetch);
  }

  ~OffloadEngine() override {
    // Blocks may still be written by copies in flight; wait before their memory goes. A
    // destructor must not throw (at exit the CUDA runtime may already be gone).
    try {
      synchronize_locked();
    } catch (...) {
    }
  }

  // Double buffering of the copies out: when group g+1 opens, the host waits for the D2H copies
  // of group g-1. Device memory of an offloaded tensor is only reusable once its copy has run, so
  // without this a forward pass that outruns the host link would keep every layer on the device.
  int64_t begin_group() {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_graph_capture_on_used_devices("begin_group");
    collect_wait_times(/*block=*/false);  // else a run that never calls stats() keeps every stall's events
    flush_staging();
    wait_for_copies_out(current_group_ - 1);
    ++current_group_;
    return current_group_;
  }

  void end_group() {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_graph_capture_on_used_devices("end_group");
    flush_staging();
  }

  int64_t current_group() {
    std::lock_guard<std::mutex> lock(mutex_);
    return current_group_;
  }

  int64_t pack(const at::Tensor& tensor) {
    std::lock_guard<std::mutex> lock(mutex_);
    at::NoGradGuard no_grad;
    check_source(tensor);
    const auto storage = tensor.storage();
    const auto version = static_cast<uint32_t>(tensor._version());
    auto* key = storage.unsafeGetStorageImpl();

    int64_t storage_id = -1;
    auto found = storage_index_.find(key);
    if (found != storage_index_.end() && storages_.at(found->second).version_at_copy == version) {
      storage_id = found->second;
      ++counters_.tensors_deduplicated;
    } else {
      storage_id = add_storage(storage, version);
      if (storage_id < 0) {
        ++counters_.refused_tensors;
        counters_.refused_bytes += static_cast<int64_t>(storage.nbytes());
        return -1;
      }
      storage_index_[key] = storage_id;
    }
    StorageEntry& entry = storages_.at(storage_id);
    Transfer& transfer = transfers_.at(entry.transfer);
    ++entry.live_handles;
    ++transfer.live_handles;
    ++transfer.pending_unpacks;

    Handle handle;
    handle.storage = storage_id;
    handle.sizes = tensor.sizes().vec();
    handle.strides = tensor.strides().vec();
    handle.storage_offset = tensor.storage_offset();
    handle.dtype = tensor.scalar_type();
    handle.version_counter = tensor.unsafeGetTensorImpl()->version_counter();
    handle.saved_version = version;
    const int64_t id = next_id_++;
    handles_.emplace(id, std::move(handle));
    ++counters_.tensors_offloaded;
    return id;
  }

  at::Tensor unpack(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    at::NoGradGuard no_grad;
    auto found = handles_.find(id);
    MEMOPT_CHECK(found != handles_.end(), kOp, "unpack: handle ", id, " is unknown or was released");
    Handle& handle = found->second;
    const uint32_t now = handle.version_counter.current_version();
    if (now != handle.saved_version) {
      std::ostringstream shape;
      shape << c10::IntArrayRef(handle.sizes);
      TORCH_CHECK(false,
                  "one of the variables needed for gradient computation has been modified by an inplace "
                  "operation: [",
                  handle.dtype, " ", shape.str(), "], which memopt.offload saved for backward, is at version ",
                  now, "; expected version ", handle.saved_version,
                  " instead. Hint: do not modify a tensor in place after autograd saved it, or clone it first.");
    }
    const StorageEntry& entry = storages_.at(handle.storage);
    const int64_t transfer_id = entry.transfer;
    Transfer& transfer = transfers_.at(transfer_id);
#ifdef MEMOPT_WITH_CUDA
    if (transfer.device.is_cuda()) refuse_graph_capture(transfer.device.index(), "unpack");
#endif
    start_backward_of(transfer.group);
    at::Tensor buffer = materialize(transfer);
    if (!handle.unpacked) {
      handle.unpacked = true;
      if (--transfer.pending_unpacks == 0) transfer.restored.reset();  // the weak ref remains
    }
    const auto element = static_cast<int64_t>(c10::elementSize(handle.dtype));
    return at::empty({0}, at::TensorOptions().dtype(handle.dtype).device(buffer.device()))
        .set_(buffer.storage(), entry.byte_offset / element + handle.storage_offset, handle.sizes, handle.strides);
  }

  void release(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = handles_.find(id);
    if (found == handles_.end()) return;
    const int64_t storage_id = found->second.storage;
    const bool unpacked = found->second.unpacked;
    handles_.erase(found);
    StorageEntry& entry = storages_.at(storage_id);
    const int64_t transfer_id = entry.transfer;
    if (--entry.live_handles == 0) {
      auto indexed = storage_index_.find(entry.key);
      if (indexed != storage_index_.end() && indexed->second == storage_id) storage_index_.erase(indexed);
      storages_.erase(storage_id);
    }
    Transfer& transfer = transfers_.at(transfer_id);
    if (!unpacked && --transfer.pending_unpacks == 0) transfer.restored.reset();
    if (--transfer.live_handles == 0) free_transfer(transfer_id);
  }

  // Starts the H2D copies of every transfer of group `group` that is not on the device yet.
  void prefetch_group(int64_t group) {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_graph_capture_on_used_devices("prefetch_group");
    prefetch_group_locked(group);
  }

  // Waits for every copy issued so far (tests and benchmarks; training never needs it).
  void synchronize() {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_graph_capture_on_used_devices("synchronize");
    synchronize_locked();
  }

  c10::Dict<std::string, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    collect_wait_times(/*block=*/true);
    c10::Dict<std::string, int64_t> out;
    out.insert("bytes_to_host", counters_.bytes_to_host);
    out.insert("bytes_to_device", counters_.bytes_to_device);
    out.insert("copies_to_host", counters_.copies_to_host);
    out.insert("copies_to_device", counters_.copies_to_device);
    out.insert("tensors_offloaded", counters_.tensors_offloaded);
    out.insert("tensors_deduplicated", counters_.tensors_deduplicated);
    out.insert("tensors_coalesced", counters_.tensors_coalesced);
    out.insert("refused_tensors", counters_.refused_tensors);
    out.insert("refused_bytes", counters_.refused_bytes);
    out.insert("prefetched_transfers", counters_.prefetched_transfers);
    out.insert("demand_transfers", counters_.demand_transfers);
    out.insert("prefetch_stalls", counters_.prefetch_stalls);
    out.insert("prefetches_skipped_oom", counters_.prefetches_skipped_oom);
    out.insert("wait_ns", counters_.wait_ns);
    out.insert("throttle_ns", counters_.throttle_ns);
    out.insert("pool_hits", counters_.pool_hits);
    out.insert("pool_misses", counters_.pool_misses);
    out.insert("pool_bytes_held", pool_bytes_held_);
    out.insert("pool_bytes_in_use", pool_bytes_in_use_);
    out.insert("host_bytes_committed", committed_bytes_);
    out.insert("live_handles", static_cast<int64_t>(handles_.size()));
    out.insert("live_transfers", static_cast<int64_t>(transfers_.size()));
    return out;
  }

 private:
  struct Counters {
    int64_t bytes_to_host = 0, bytes_to_device = 0, copies_to_host = 0, copies_to_device = 0;
    int64_t tensors_offloaded = 0, tensors_deduplicated = 0, tensors_coalesced = 0;
    int64_t refused_tensors = 0, refused_bytes = 0;
    int64_t prefetched_transfers = 0, demand_transfers = 0, prefetch_stalls = 0, prefetches_skipped_oom = 0;
    int64_t wait_ns = 0, throttle_ns = 0;
    int64_t pool_hits = 0, pool_misses = 0;
  };

  void check_source(const at::Tensor& tensor) const {
    MEMOPT_CHECK(tensor.defined(), kOp, "pack: tensor is undefined");
    MEMOPT_CHECK(tensor.layout() == at::kStrided, kOp, "pack: tensor must be strided, got layout ",
                 tensor.layout());
    MEMOPT_CHECK(!tensor.is_conj() && !tensor.is_neg(), kOp,
                 "pack: tensor has the conjugate or negative bit set; resolve it first (tensor.resolve_conj())");
    if (tensor.is_cuda()) {
#ifdef MEMOPT_WITH_CUDA
      refuse_graph_capture(tensor.device().index(), "pack");
#else
      MEMOPT_CHECK(false, kOp, "pack: got a CUDA tensor but memopt._C was built without CUDA");
#endif
      return;
    }
    MEMOPT_CHECK(tensor.is_cpu() && allow_cpu_source_, kOp, "pack: tensor must be a CUDA tensor",
                 tensor.is_cpu() ? " (CPU tensors only with allow_cpu_source=True)" : "", ", got one on ",
                 tensor.device());
  }

  void refuse_graph_capture_on_used_devices(const char* what) const {
#ifdef MEMOPT_WITH_CUDA
    for (const auto& entry : streams_) refuse_graph_capture(entry.first, what);
#else
    (void)what;
#endif
  }

  bool reserve(int64_t bytes) {
    if (max_host_bytes_ >= 0 && committed_bytes_ + bytes > max_host_bytes_) return false;
    committed_bytes_ += bytes;
    return true;
  }

  int64_t add_storage(const c10::Storage& storage, uint32_t version) {
    const auto nbytes = static_cast<int64_t>(storage.nbytes());
    StorageEntry entry;
    entry.nbytes = nbytes;
    entry.key = storage.unsafeGetStorageImpl();
    entry.source = storage.getWeakStorageImpl();
    entry.version_at_copy = version;
    if (nbytes < coalesce_bytes_) {
      // A staging transfer holds the budget its flush will take, the size class of the bytes
      // packed into it so far, and grows it piece by piece: a budget smaller than staging_bytes
      // still takes every small tensor that fits it.
      Transfer* staging = staging_transfer_ >= 0 ? &transfers_.at(staging_transfer_) : nullptr;
      const int64_t offset = staging ? align_up(staging->nbytes, kSegmentAlign) : 0;
      if (staging && (staging->device != storage.device() || offset + nbytes > staging_bytes_ ||
                      !reserve(size_class(offset + nbytes) - staging->reserved))) {
        flush_staging();  // full, on another device, or grown past the budget: a new one
        staging = nullptr;
      }
      if (staging) {
        staging->reserved = size_class(offset + nbytes);  // the growth was reserved in the test above
      } else {
        const int64_t reservation = size_class(nbytes);
        if (!reserve(reservation)) return -1;  // the tensor alone does not fit
        staging_transfer_ = new_transfer(storage.device(), reservation);
        staging = &transfers_.at(staging_transfer_);
      }
      entry.transfer = staging_transfer_;
      entry.byte_offset = align_up(staging->nbytes, kSegmentAlign);
      staging->staged.push_back(StagedPiece{storage, entry.byte_offset, nbytes});
      staging->nbytes = entry.byte_offset + nbytes;
#ifdef MEMOPT_WITH_CUDA
      // The flush may run under another current stream (a later layer's, or backward's): it must
      // wait for the stream this storage was produced on.
      if (storage.device().is_cuda()) {
        const auto producer = c10::cuda::getCurrentCUDAStream(storage.device().index());
        auto& producers = staging->producers;
        if (std::find(producers.begin(), producers.end(), producer) == producers.end()) producers.push_back(producer);
      }
#endif
      ++counters_.tensors_coalesced;
    } else {
      const int64_t reservation = size_class(nbytes);
      if (!reserve(reservation)) return -1;
      entry.transfer = new_transfer(storage.device(), reservation);
      Transfer& transfer = transfers_.at(entry.transfer);
      transfer.nbytes = nbytes;
      try {
        copy_to_host(transfer, storage_bytes(storage), {storage});
      } catch (...) {
        free_transfer(entry.transfer);  // no handle refers to it: give back its budget
        throw;
      }
    }
    const int64_t id = next_id_++;
    storages_.emplace(id, std::move(entry));
    return id;
  }

  int64_t new_transfer(c10::Device device, int64_t reservation) {
    const int64_t id = next_id_++;
    Transfer transfer;
    transfer.group = current_group_;
    transfer.device = device;
    transfer.reserved = reservation;
    transfers_.emplace(id, std::move(transfer));
    groups_[current_group_].transfers.push_back(id);
    return id;
  }

  // Copies the staged storages into one device buffer, then to the host in one copy. On failure
  // the transfer stays uncopied and is no longer staging: its handles raise at unpack.
  void flush_staging() {
    if (staging_transfer_ < 0) return;
    Transfer& transfer = transfers_.at(staging_transfer_);
    staging_transfer_ = -1;
    const std::vector<StagedPiece> staged = std::move(transfer.staged);
    transfer.staged.clear();
    std::vector<c10::Storage> sources;
    for (const auto& piece : staged) {
      // The segment layout was fixed at pack time: a storage that shrank since cannot fill its
      // segment (one that grew keeps its packed bytes as a prefix, and only those are copied).
      const auto now = static_cast<int64_t>(piece.source.nbytes());
      MEMOPT_CHECK(now >= piece.nbytes, kOp, "the storage of a saved tensor shrank from ", piece.nbytes, " to ",
                   now, " bytes after it was packed, before its group was copied to the host");
      sources.push_back(piece.source);
    }
    const bool on_cuda = transfer.device.is_cuda();
#ifdef MEMOPT_WITH_CUDA
    // The staging buffer is allocated and used only on the offload stream, so freeing it right
    // after is safe; copy_to_host runs under this guard and finds its producers waited on.
    std::optional<c10::cuda::CUDAStreamGuard> on_offload_stream;
    if (on_cuda) {
      auto& side = streams(transfer.device.index());
      for (const auto& producer : transfer.producers) record_event(producer)->block(side.to_host);
      transfer.producers.clear();
      on_offload_stream.emplace(side.to_host);
    }
#endif
    at::Tensor staging =
        at::empty({transfer.nbytes}, at::TensorOptions().dtype(at::kByte).device(transfer.device));
    for (const auto& piece : staged) {
      staging.narrow(0, piece.byte_offset, piece.nbytes)
          .copy_(storage_bytes(piece.source).narrow(0, 0, piece.nbytes), /*non_blocking=*/on_cuda);
    }
    copy_to_host(transfer, staging, sources);
  }

  // Lends `transfer` a host block and issues the copy of `bytes` (uint8 [transfer.nbytes]) into it.
  // `sources` are the storages `bytes` was read from (kept safe from reuse until the copy ran).
  // Changes nothing in `transfer` or the pool's accounting if it throws.
  void copy_to_host(Transfer& transfer, const at::Tensor& bytes, const std::vector<c10::Storage>& sources) {
    const int64_t cls = size_class(transfer.nbytes);
    HostBlock block = acquire_block(cls, transfer.device);
    try {
      at::Tensor host = block.buffer.narrow(0, 0, transfer.nbytes);
#ifdef MEMOPT_WITH_CUDA
      if (transfer.device.is_cuda()) {
        const auto device = transfer.device.index();
        const auto current = c10::cuda::getCurrentCUDAStream(device);
        auto& side = streams(device);
        // Under flush_staging the current stream is the offload stream itself, already ordered
        // after the producers: a second event would only wait on itself.
        if (current != side.to_host) record_event(current)->block(side.to_host);
        // Recorded before the copy is issued: the allocator acts on it when a source is freed,
        // which cannot happen before this call returns.
        for (const auto& source : sources) storage_bytes(source).record_stream(side.to_host);
        {
          c10::cuda::CUDAStreamGuard guard(side.to_host);
          host.copy_(bytes, /*non_blocking=*/true);
        }
        block.last_use = record_event(side.to_host);
        transfer.d2h_done = block.last_use;
      } else
#endif
      {
        (void)sources;
        host.copy_(bytes);
      }
    } catch (...) {
      return_block(std::move(block));
      throw;
    }
    transfer.block = std::move(block);
    transfer.copied = true;
    counters_.bytes_to_host += transfer.nbytes;
    ++counters_.copies_to_host;
  }

  HostBlock acquire_block(int64_t cls, c10::Device source_device) {
    auto& free_list = free_blocks_[cls];
    if (!free_list.empty()) {
      HostBlock block = std::move(free_list.back());
      free_list.pop_back();
#ifdef MEMOPT_WITH_CUDA
      if (block.last_use) block.last_use->synchronize();
      block.last_use.reset();
#endif
      ++counters_.pool_hits;
      pool_bytes_in_use_ += cls;
      return block;
    }
    ++counters_.pool_misses;
    // Stay inside the budget: give back idle blocks of other size classes first.
    if (max_host_bytes_ >= 0) evict_free_blocks(max_host_bytes_ - cls);
    HostBlock block;
    block.size_class = cls;
#ifdef MEMOPT_WITH_CUDA
    if (pin_memory_ && source_device.is_cuda()) block.buffer = allocate_pinned(cls, source_device.index());
#endif
    if (!block.buffer.defined()) block.buffer = at::empty({cls}, at::TensorOptions().dtype(at::kByte));
    pool_bytes_held_ += cls;
    pool_bytes_in_use_ += cls;
    return block;
  }

  void evict_free_blocks(int64_t target_held) {
    for (auto it = free_blocks_.rbegin(); it != free_blocks_.rend() && pool_bytes_held_ > target_held; ++it) {
      auto& list = it->second;
      while (!list.empty() && pool_bytes_held_ > target_held) {
#ifdef MEMOPT_WITH_CUDA
        if (list.back().last_use) list.back().last_use->synchronize();
#endif
        pool_bytes_held_ -= list.back().size_class;
        list.pop_back();
      }
    }
  }

  // Back to the pool with the event of its last copy (acquire_block waits on it before lending it).
  void return_block(HostBlock block) {
    pool_bytes_in_use_ -= block.size_class;
    free_blocks_[block.size_class].push_back(std::move(block));
  }

  void free_transfer(int64_t id) {
    Transfer& transfer = transfers_.at(id);
    if (staging_transfer_ == id) staging_transfer_ = -1;
    committed_bytes_ -= transfer.reserved;
    if (transfer.block.buffer.defined()) return_block(std::move(transfer.block));
    auto group = groups_.find(transfer.group);
    if (group != groups_.end()) {
      auto& list = group->second.transfers;
      list.erase(std::remove(list.begin(), list.end(), id), list.end());
      if (list.empty()) groups_.erase(group);
    }
    transfers_.erase(id);
  }

  void wait_for_copies_out(int64_t up_to_group) {
#ifdef MEMOPT_WITH_CUDA
    for (auto& entry : groups_) {
      if (entry.first > up_to_group) break;
      Group& group = entry.second;
      if (group.copies_out_finished) continue;
      const auto start = std::chrono::steady_clock::now();
      for (int64_t id : group.transfers) {
        const Transfer& transfer = transfers_.at(id);
        if (transfer.d2h_done) transfer.d2h_done->synchronize();
      }
      counters_.throttle_ns +=
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
      group.copies_out_finished = true;
    }
#else
    (void)up_to_group;
#endif
  }

  // The first unpack of a group in backward starts the copies of the `prefetch_` groups before it
  // (groups that hold copies: a layer that saved nothing offloadable does not use up the lookahead).
  void start_backward_of(int64_t group) {
    auto found = groups_.find(group);
    if (found == groups_.end() || found->second.backward_started) return;
    found->second.backward_started = true;
    std::vector<int64_t> ahead;
    for (auto it = found; it != groups_.begin() && static_cast<int64_t>(ahead.size()) < prefetch_;) {
      --it;
      if (!it->second.transfers.empty()) ahead.push_back(it->first);
    }
    for (int64_t earlier : ahead) prefetch_group_locked(earlier);
  }

  void prefetch_group_locked(int64_t group) {
    auto found = groups_.find(group);
    if (found == groups_.end()) return;
    if (staging_transfer_ >= 0 && transfers_.at(staging_transfer_).group == group) flush_staging();
    for (int64_t id : found->second.transfers) {
      Transfer& transfer = transfers_.at(id);
      if (!transfer.copied || transfer.restored.defined() || !transfer.restored_weak.expired() ||
          transfer.pending_unpacks == 0) {
        continue;  // (uncopied after the flush above: its flush failed, unpack reports it)
      }
      try {
        copy_to_device(transfer);
      } catch (const c10::OutOfMemoryError&) {
        // Prefetching is an optimisation: with the device full, leave this group to the copies on
        // demand at its unpack, when the backward of later layers has freed their memory.
        ++counters_.prefetches_skipped_oom;
        return;
      }
      ++counters_.prefetched_transfers;
    }
  }

  // The transfer's device buffer: held by the engine until every handle was unpacked once, and
  // weakly afterwards (a second backward with retain_graph reuses it while it lives, or copies again).
  at::Tensor materialize(Transfer& transfer) {
    if (!transfer.copied) flush_staging();
    MEMOPT_CHECK(transfer.copied, kOp,
                 "unpack: this saved tensor never reached the host: the copy of its group failed earlier "
                 "(see the error raised then), so it cannot be restored");
    at::Tensor buffer = transfer.restored;
    if (!buffer.defined()) {
      auto alive = transfer.restored_weak.lock();
      if (alive) {
        buffer = storage_bytes(c10::Storage(std::move(alive)));
      } else {
        copy_to_device(transfer);
        ++counters_.demand_transfers;
        buffer = transfer.restored;
      }
    }
#ifdef MEMOPT_WITH_CUDA
    if (transfer.device.is_cuda() && transfer.h2d_done) {
      const auto current = c10::cuda::getCurrentCUDAStream(transfer.device.index());
      // A prefetch allocates the buffer on the stream current then (the backward of a later
      // layer); if this consumer runs on another stream, freeing the buffer must wait for it too
      // (the allocator ignores a record on the allocation stream itself).
      buffer.record_stream(current);
      if (!transfer.h2d_done->query()) {
        ++counters_.prefetch_stalls;
        auto start = record_event(current, /*timing=*/true);
        transfer.h2d_done->block(current);
        waits_.emplace_back(std::move(start), record_event(current, /*timing=*/true));
      } else {
        transfer.h2d_done->block(current);
      }
    }
#endif
    return buffer;
  }

  void copy_to_device(Transfer& transfer) {
    const auto options = at::TensorOptions().dtype(at::kByte).device(transfer.device);
    at::Tensor host = transfer.block.buffer.narrow(0, 0, transfer.nbytes);
#ifdef MEMOPT_WITH_CUDA
    if (transfer.device.is_cuda()) {
      const auto device = transfer.device.index();
      const auto current = c10::cuda::getCurrentCUDAStream(device);
      auto& side = streams(device);
      // Allocated on the current stream, whose queued work may still read this memory.
      at::Tensor buffer = at::empty({transfer.nbytes}, options);
      record_event(current)->block(side.to_device);
      transfer.d2h_done->block(side.to_device);
      {
        c10::cuda::CUDAStreamGuard guard(side.to_device);
        buffer.copy_(host, /*non_blocking=*/true);
      }
      buffer.record_stream(side.to_device);
      transfer.h2d_done = record_event(side.to_device);
      transfer.block.last_use = transfer.h2d_done;
      finish_copy_to_device(transfer, buffer);
      return;
    }
#endif
    at::Tensor buffer = at::empty({transfer.nbytes}, options);
    buffer.copy_(host);
    finish_copy_to_device(transfer, buffer);
  }

  void finish_copy_to_device(Transfer& transfer, const at::Tensor& buffer) {
    transfer.restored = buffer;
    transfer.restored_weak = buffer.storage().getWeakStorageImpl();
    counters_.bytes_to_device += transfer.nbytes;
    ++counters_.copies_to_device;
  }

  void synchronize_locked() {
#ifdef MEMOPT_WITH_CUDA
    for (auto& entry : streams_) {
      entry.second.to_host.synchronize();
      entry.second.to_device.synchronize();
    }
    collect_wait_times(/*block=*/true);
#endif
  }

  void collect_wait_times(bool block) {
#ifdef MEMOPT_WITH_CUDA
    auto it = waits_.begin();
    while (it != waits_.end()) {
      if (!block && !it->second->query()) {
        ++it;
        continue;
      }
      it->second->synchronize();
      counters_.wait_ns += static_cast<int64_t>(static_cast<double>(it->first->elapsed_time(*it->second)) * 1e6);
      it = waits_.erase(it);
    }
#else
    (void)block;
#endif
  }

#ifdef MEMOPT_WITH_CUDA
  struct SideStreams {
    c10::cuda::CUDAStream to_host;
    c10::cuda::CUDAStream to_device;
  };

  SideStreams& streams(c10::DeviceIndex device) {
    auto found = streams_.find(device);
    if (found == streams_.end()) {
      found = streams_
                  .emplace(device, SideStreams{c10::cuda::getStreamFromPool(false, device),
                                               c10::cuda::getStreamFromPool(false, device)})
                  .first;
    }
    return found->second;
  }

  std::map<c10::DeviceIndex, SideStreams> streams_;
  std::vector<std::pair<EventPtr, EventPtr>> waits_;  // (start, end) on the consumer stream
#endif

  const int64_t max_host_bytes_;
  const bool pin_memory_;
  const bool allow_cpu_source_;
  const int64_t coalesce_bytes_;
  const int64_t staging_bytes_;
  const int64_t prefetch_;

  std::mutex mutex_;
  int64_t next_id_ = 0;
  int64_t current_group_ = 0;
  int64_t staging_transfer_ = -1;
  int64_t committed_bytes_ = 0;
  int64_t pool_bytes_held_ = 0;
  int64_t pool_bytes_in_use_ = 0;
  Counters counters_;
  std::unordered_map<int64_t, Handle> handles_;
  std::unordered_map<int64_t, StorageEntry> storages_;
  std::unordered_map<c10::StorageImpl*, int64_t> storage_index_;
  std::unordered_map<int64_t, Transfer> transfers_;
  std::map<int64_t, Group> groups_;
  std::map<int64_t, std::vector<HostBlock>> free_blocks_;
};

}  // namespace
}  // namespace memopt

TORCH_LIBRARY_FRAGMENT(memopt, m) {
  m.class_<memopt::OffloadEngine>("OffloadEngine")
      .def(torch::init<int64_t, bool, bool, int64_t, int64_t, int64_t>())
      .def("pack", &memopt::OffloadEngine::pack)
      .def("unpack", &memopt::OffloadEngine::unpack)
      .def("release", &memopt::OffloadEngine::release)
      .def("begin_group", &memopt::OffloadEngine::begin_group)
      .def("end_group", &memopt::OffloadEngine::end_group)
      .def("current_group", &memopt::OffloadEngine::current_group)
      .def("prefetch_group", &memopt::OffloadEngine::prefetch_group)
      .def("synchronize", &memopt::OffloadEngine::synchronize)
      .def("stats", &memopt::OffloadEngine::stats);
}
