// The cache operators' CPU kernels, in C++, for a step whose copies run on a NativeLink's copy thread.
//
// The operators (hyperoffload::offload, offload.into, prefetch, wait, release, release.live) are defined, with
// their fake kernels and their Python kernels, in hyperoffload/cache_ops.py. Loaded (hyperoffload.runtime.
// native_kernels), this library becomes their CPU kernel. While a "native state" is active on the calling thread
// (an AsyncCopies over a NativeLink, inside copies_on), the kernels do the AsyncCopies bookkeeping here and issue
// the copies straight to the copy thread (copy_thread.c's ho_submit), so that a compiled step pays about a
// microsecond per cache operator instead of the several a Python kernel costs behind the dispatcher. Otherwise
// they call the Python kernels (hyperoffload::_python_<op>), which do what they always did.
//
// The bookkeeping is AsyncCopies' (cache_ops.py), entry for entry:
//   pending  the copy into each remote or device buffer not waited for yet, by the buffer's storage address,
//            in issue order; the entry holds the buffer's storage, so no other buffer takes that address;
//   reading  the offload reading each device storage, in issue order, holding the storage until the copy has
//            completed (its ideal end on the link's clock has passed), which is when the step lets go of it;
//   moving   every copy whose bytes have not moved yet, holding both its storages (as a NativeTransfer does), per
//            direction: the copy thread moves each direction in order but may move a later copy of one before an
//            earlier one of the other, whose storages must not keep the first's alive;
//   pool     the remote buffers of offloads, by size, each handed out again once only the pool holds it.
// A state is used by one thread at a time; states are created and freed by the hyperoffload_native ops below.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/alias.h>
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <time.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

extern "C" {
int64_t ho_submit(void *handle, int d, void *dst, const void *src, size_t nbytes, int after_dir, int64_t after_seq);
double ho_poll(void *handle, int d, int64_t seq);
double ho_wait(void *handle, int d, int64_t seq, int complete, double spin_s);
}

namespace {

constexpr int H2D = 0, D2H = 1;  // copy_thread.c's directions

double now_s() {  // copy_thread.c's clock (CLOCK_MONOTONIC, Python's time.perf_counter on Linux)
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

struct Copy {
    int dir = -1;
    int64_t seq = 0;
    c10::Storage storage;  // the buffer the table's key is the address of
    double end_s = -1.0;   // the ideal end, once the bytes have moved (-1 until then)
};

// An insertion-ordered table of copies by storage address (Python's dict, as AsyncCopies uses it).
class Table {
  public:
    void put(const void *key, Copy copy) {
        pop(key);
        uint64_t at = next_++;
        rows_.emplace(at, std::make_pair(key, std::move(copy)));
        index_[key] = at;
    }
    std::optional<Copy> pop(const void *key) {
        auto found = index_.find(key);
        if (found == index_.end()) return std::nullopt;
        auto row = rows_.find(found->second);
        Copy copy = std::move(row->second.second);
        rows_.erase(row);
        index_.erase(found);
        return copy;
    }
    const Copy *find(const void *key) const {
        auto found = index_.find(key);
        return found == index_.end() ? nullptr : &rows_.at(found->second).second;
    }
    bool empty() const { return rows_.empty(); }
    size_t size() const { return rows_.size(); }
    Copy &front() { return rows_.begin()->second.second; }
    Copy &back() { return rows_.rbegin()->second.second; }
    void pop_front() {
        index_.erase(rows_.begin()->second.first);
        rows_.erase(rows_.begin());
    }
    void clear() {
        rows_.clear();
        index_.clear();
    }
    template <class Pred> void erase_if(Pred pred) {
        for (auto row = rows_.begin(); row != rows_.end();) {
            if (pred(row->second.second)) {
                index_.erase(row->second.first);
                row = rows_.erase(row);
            } else {
                ++row;
            }
        }
    }

  private:
    std::map<uint64_t, std::pair<const void *, Copy>> rows_;
    std::unordered_map<const void *, uint64_t> index_;
    uint64_t next_ = 0;
};

struct Moving {  // a copy whose bytes have not moved: both its storages are held until they have
    int dir;
    int64_t seq;
    c10::Storage src, dst;
};

struct State {
    void *link;
    double spin_s;
    bool release_waits;
    bool move_bytes;  // false: each copy is issued and timed as a copy of no bytes (what the operators cost alone)
    Table pending, reading;
    std::deque<Moving> moving[2];  // by direction: each direction's copies move in order, the two do not
    std::unordered_map<size_t, std::vector<c10::Storage>> pool;
    std::unordered_map<size_t, size_t> pool_next;
    size_t prune_at = 64;
    // Counters, AsyncCopies' fields of the same names.
    int64_t waits = 0, overlapped_waits = 0, h2d_bytes = 0, d2h_bytes = 0, release_stalls = 0;
    double release_wait_s = 0.0, wait_s = 0.0;

    State(void *link, double spin_s, bool release_waits, bool move_bytes)
        : link(link), spin_s(spin_s), release_waits(release_waits), move_bytes(move_bytes) {}

    int64_t submit(int dir, void *dst, const void *src, size_t nbytes, int after_dir, int64_t after_seq) {
        return ho_submit(link, dir, dst, src, move_bytes ? nbytes : 0, after_dir, after_seq);
    }

    bool moved(Copy &copy) {
        if (copy.end_s < 0) copy.end_s = ho_poll(link, copy.dir, copy.seq);
        return copy.end_s >= 0;
    }
    bool completed(Copy &copy) { return moved(copy) && now_s() >= copy.end_s; }

    void block(const Copy &copy, bool complete) { ho_wait(link, copy.dir, copy.seq, complete ? 1 : 0, spin_s); }

    // Let go of the device storages of completed offloads, oldest first, and of the storages of moved copies.
    void reap() {
        while (!reading.empty() && completed(reading.front())) reading.pop_front();
        for (auto &queue : moving)
            while (!queue.empty() && ho_poll(link, queue.front().dir, queue.front().seq) >= 0) queue.pop_front();
    }

    void started(int dir, int64_t seq, const c10::Storage &src, const c10::Storage &dst) {
        reap();
        if (pending.size() + reading.size() > prune_at) {  // copies that completed and were never waited for
            auto done = [this](Copy &copy) { return completed(copy); };
            pending.erase_if(done);
            reading.erase_if(done);
            prune_at = std::max<size_t>(64, 2 * (pending.size() + reading.size()));
        }
        pending.put(dst.data(), Copy{dir, seq, dst});
        moving[dir].push_back(Moving{dir, seq, src, dst});
    }

    c10::Storage take(size_t nbytes) {  // a pool storage only the pool holds, or a new one
        auto &kept = pool[nbytes];
        size_t &start = pool_next[nbytes];
        for (size_t k = 0; k < kept.size(); ++k) {
            size_t i = (start + k) % kept.size();
            if (kept[i].use_count() == 1) {
                start = i + 1;
                return kept[i];
            }
        }
        kept.push_back(c10::Storage(c10::Storage::use_byte_size_t(), nbytes, c10::GetCPUAllocator(), false));
        start = kept.size();
        return kept.back();
    }

    int64_t pool_bytes() const {
        int64_t total = 0;
        for (const auto &[size, kept] : pool) total += (int64_t)(size * kept.size());
        return total;
    }

    void offload_into(const c10::Storage &storage, const c10::Storage &into) {
        int64_t seq = submit(D2H, into.mutable_data(), storage.data(), storage.nbytes(), -1, 0);
        d2h_bytes += (int64_t)storage.nbytes();
        started(D2H, seq, storage, into);
        reading.put(storage.data(), Copy{D2H, seq, storage});
    }

    at::Tensor prefetch(const at::Tensor &remote, int64_t elements) {
        const c10::Storage &storage = remote.storage();
        at::Tensor dst = at::empty({elements}, remote.options());
        const c10::Storage &into = dst.storage();
        const Copy *after = pending.find(storage.data());
        int64_t seq = submit(H2D, into.mutable_data(), storage.data(), storage.nbytes(), after ? after->dir : -1,
                             after ? after->seq : 0);
        h2d_bytes += (int64_t)storage.nbytes();
        started(H2D, seq, storage, into);
        return dst;
    }

    void wait_for(const void *key) {
        std::optional<Copy> copy = pending.pop(key);
        if (!copy) {
            reap();
            return;
        }
        waits += 1;
        if (!pending.empty()) overlapped_waits += !completed(pending.back());
        double start = now_s();
        block(*copy, true);
        wait_s += now_s() - start;
        reap();
    }

    void released(const void *key) {
        std::optional<Copy> copy = reading.pop(key);
        reap();
        if (!copy || completed(*copy)) return;
        release_stalls += 1;
        if (release_waits) {
            double start = now_s();
            block(*copy, true);
            release_wait_s += now_s() - start;
            reap();  // the copy holds the storage in `moving` too: the release is where the plan lets go of it
        }
    }

    void drain() {
        for (auto &queue : moving) {
            for (const auto &m : queue) ho_wait(link, m.dir, m.seq, 0, spin_s);
            queue.clear();
        }
    }

    // After drain(): forget every copy and the remote buffers only the pool holds (AsyncCopies.drain's reset).
    void forget() {
        pending.clear();
        reading.clear();
        pool.clear();
        pool_next.clear();
    }
};

// The states, by id (1, 2, ...; 0 is "none"), and the one active on each thread.
std::mutex states_lock;
std::unordered_map<int64_t, std::unique_ptr<State>> states;
int64_t next_id = 1;
thread_local State *active = nullptr;
thread_local int64_t active_id = 0;

State &state(int64_t id) {
    std::lock_guard<std::mutex> guard(states_lock);
    auto found = states.find(id);
    TORCH_CHECK(found != states.end(), "hyperoffload native copies: no state ", id, " (it was closed)");
    return *found->second;
}

int64_t storage_elements(const at::Tensor &x) { return (int64_t)(x.storage().nbytes() / x.element_size()); }

at::Tensor flat_storage(const at::Tensor &x) { return x.as_strided({storage_elements(x)}, {1}, 0); }

c10::OperatorHandle python_kernel(const char *name, const char *overload) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

// --- the cache operators' CPU kernels -------------------------------------------------------------------------------
at::Tensor offload(const at::Tensor &x) {
    if (active == nullptr) {
        static auto op = python_kernel("hyperoffload::_python_offload", "").typed<at::Tensor(const at::Tensor &)>();
        return op.call(x);
    }
    const c10::Storage &storage = x.storage();
    size_t nbytes = storage.nbytes(), itemsize = x.element_size();
    if (nbytes % itemsize) return flat_storage(x).clone();  // a storage not whole elements: copied now
    at::Tensor dst = at::empty({0}, x.options());
    dst.set_(active->take(nbytes), 0, {(int64_t)(nbytes / itemsize)}, {1});
    active->offload_into(storage, dst.storage());
    return dst;
}

void offload_into(const at::Tensor &x, const at::Tensor &remote) {
    if (active == nullptr) {
        static auto op = python_kernel("hyperoffload::_python_offload_into", "")
                             .typed<void(const at::Tensor &, const at::Tensor &)>();
        return op.call(x, remote);
    }
    const c10::Storage &storage = x.storage(), &into = remote.storage();
    TORCH_CHECK_VALUE(storage.nbytes() == into.nbytes(), "offload.into: the device storage has ", storage.nbytes(),
                      " bytes, the remote buffer ", into.nbytes());
    active->offload_into(storage, into);
}

at::Tensor prefetch(const at::Tensor &remote, std::optional<at::Device> device) {
    if (active == nullptr || (device.has_value() && !device->is_cpu())) {
        static auto op = python_kernel("hyperoffload::_python_prefetch", "")
                             .typed<at::Tensor(const at::Tensor &, std::optional<at::Device>)>();
        return op.call(remote, device);
    }
    if (remote.storage().nbytes() % remote.element_size()) return flat_storage(remote).clone();
    return active->prefetch(remote, storage_elements(remote));
}

at::Tensor wait(const at::Tensor &x) {
    if (active == nullptr) {
        static auto op = python_kernel("hyperoffload::_python_wait", "").typed<at::Tensor(const at::Tensor &)>();
        return op.call(x);
    }
    active->wait_for(x.storage().data());
    return at::alias(x);
}

void release(const at::Tensor &x) {
    if (active == nullptr) {
        static auto op = python_kernel("hyperoffload::_python_release", "").typed<void(const at::Tensor &)>();
        return op.call(x);
    }
    active->released(x.storage().data());
}

void release_live(const at::Tensor &x, at::TensorList live) { release(x); }  // `live` only orders the graph

// --- the states: hyperoffload_native ops, called from hyperoffload.runtime.native_kernels ------------------------------
int64_t open_state(int64_t link, double spin_s, bool release_waits, bool move_bytes) {
    TORCH_CHECK(link != 0, "hyperoffload native copies: the link is closed");
    std::lock_guard<std::mutex> guard(states_lock);
    int64_t id = next_id++;
    states.emplace(id, std::make_unique<State>(reinterpret_cast<void *>(link), spin_s, release_waits, move_bytes));
    return id;
}

int64_t activate(int64_t id) {
    int64_t previous = active_id;
    active = id == 0 ? nullptr : &state(id);
    active_id = id;
    return previous;
}

std::vector<double> stats(int64_t id) {
    State &s = state(id);
    return {(double)s.waits,          (double)s.overlapped_waits, (double)s.h2d_bytes,       (double)s.d2h_bytes,
            (double)s.release_stalls, s.release_wait_s,           s.wait_s,                  (double)s.pool_bytes(),
            (double)s.pending.size(), (double)s.reading.size(),   (double)(s.moving[H2D].size() + s.moving[D2H].size())};
}

void drain(int64_t id) {
    State &s = state(id);
    s.drain();
    s.forget();
}

void close_state(int64_t id, bool link_open) {
    std::unique_ptr<State> gone;
    {
        std::lock_guard<std::mutex> guard(states_lock);
        auto found = states.find(id);
        if (found == states.end()) return;
        gone = std::move(found->second);
        states.erase(found);
    }
    if (link_open) gone->drain();  // no storage is freed under a copy still moving it
    if (active == gone.get()) {
        active = nullptr;
        active_id = 0;
    }
}

}  // namespace

TORCH_LIBRARY_IMPL(hyperoffload, CPU, m) {
    m.impl("offload", offload);
    m.impl("offload.into", offload_into);
    m.impl("prefetch", prefetch);
    m.impl("wait", wait);
    m.impl("release", release);
    m.impl("release.live", release_live);
}

TORCH_LIBRARY(hyperoffload_native, m) {
    m.def("open(int link, float spin_s, bool release_waits, bool move_bytes) -> int", open_state);
    m.def("activate(int id) -> int", activate);
    m.def("stats(int id) -> float[]", stats);
    m.def("drain(int id) -> ()", drain);
    m.def("close(int id, bool link_open) -> ()", close_state);
}
