"""`emu_fibers.h`, the header the kernel-emulation shims include: emulated CUDA threads as fibers.

A launch's threads run as fibers (`ucontext`) on the OS thread that launches them, each on a stack of its own, and
switch only where a CUDA thread waits: a barrier (`EmuBarrier`, in place of `std::barrier`) or an mbarrier phase.
One OS thread per CUDA thread (the emulation's first form) put up to ~300 runnable threads on a 2-core machine and
slowed every other test process; fibers keep one runnable thread per launch.

Order: the scheduler runs every live fiber once per pass, in an order shuffled per pass (a fixed seed, so a run
repeats): between two waits, a thread runs alone, and which one runs first changes from phase to phase, so a read of
another thread's write without a barrier between them sees the old value in about half the phases, and a test fails.
A pass in which no fiber got past a wait (the waits are on bulk copies still landing, on threads of their own) sleeps
20 µs; 30 s of that is a deadlock, and the emulation aborts with a message.

Per-thread state of the shims (threadIdx, ...) lives in a struct per fiber (`EmuFiber::locals`), which the shims
reach through macros, not in `thread_local` variables (all fibers share one OS thread).
"""

FIBERS_H = r"""
#pragma once
#include <ucontext.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

struct EmuFiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  std::function<void()> body;
  void* locals = nullptr;  // the shim's per-thread state
  bool done = false;
};
inline thread_local EmuFiber* emu_fiber = nullptr;  // the running fiber; null in host code
inline thread_local ucontext_t* emu_scheduler = nullptr;
// Bumped whenever a wait may end: a barrier released, a fiber finished, an mbarrier phase completed (on a copy
// thread too). A scheduler pass that leaves it unchanged made no progress.
inline std::atomic<uint64_t> emu_progress{0};

inline void emu_yield() {
  if (emu_fiber == nullptr) std::abort();  // a wait outside a launch
  swapcontext(&emu_fiber->context, emu_scheduler);
}

// std::barrier's arrive_and_wait for the fibers of one launch (one OS thread: no atomics needed).
class EmuBarrier {
 public:
  explicit EmuBarrier(int count) : count_(count) {}
  void arrive_and_wait() {
    const uint64_t generation = generation_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++generation_;
      emu_progress.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    while (generation_ == generation) emu_yield();
  }

 private:
  int count_, arrived_ = 0;
  uint64_t generation_ = 0;
};

inline void emu_fiber_main() {
  emu_fiber->body();
  emu_fiber->done = true;
}  // returns to the scheduler (uc_link)

// Run `bodies` as fibers until all return; fiber i's locals are `locals[i]`.
inline void emu_run_fibers(std::vector<std::function<void()>>& bodies, const std::vector<void*>& locals) {
  constexpr size_t kStack = size_t(1) << 20;  // untouched pages are never committed
  ucontext_t scheduler;
  std::vector<std::unique_ptr<EmuFiber>> fibers;
  for (size_t i = 0; i < bodies.size(); ++i) {
    auto f = std::make_unique<EmuFiber>();
    f->body = std::move(bodies[i]);
    f->locals = locals[i];
    f->stack.reset(new char[kStack]);
    getcontext(&f->context);
    f->context.uc_stack.ss_sp = f->stack.get();
    f->context.uc_stack.ss_size = kStack;
    f->context.uc_link = &scheduler;
    makecontext(&f->context, emu_fiber_main, 0);
    fibers.push_back(std::move(f));
  }
  ucontext_t* const outer = emu_scheduler;
  emu_scheduler = &scheduler;
  std::vector<size_t> order(fibers.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::mt19937 rng(20261203u);
  size_t live = fibers.size();
  auto stuck_since = std::chrono::steady_clock::now();
  while (live > 0) {
    std::shuffle(order.begin(), order.end(), rng);
    const uint64_t before = emu_progress.load();
    for (size_t i : order) {
      EmuFiber* f = fibers[i].get();
      if (f->done) continue;
      emu_fiber = f;
      swapcontext(&scheduler, &f->context);
      emu_fiber = nullptr;
      if (f->done) {
        --live;
        emu_progress.fetch_add(1, std::memory_order_relaxed);
      }
    }
    if (emu_progress.load() != before) {
      stuck_since = std::chrono::steady_clock::now();
    } else if (std::chrono::steady_clock::now() - stuck_since > std::chrono::seconds(30)) {
      std::fprintf(stderr, "kernel emulation: %zu threads made no progress for 30 s (a deadlock)\n", live);
      std::abort();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  emu_scheduler = outer;
}

// Launch `count` emulated threads: `body(i)` on a fiber whose shim state is a fresh `Locals`.
template <typename Locals, typename Body>
void emu_launch(size_t count, Body body) {
  std::vector<Locals> state(count);
  std::vector<void*> locals;
  std::vector<std::function<void()>> bodies;
  for (size_t i = 0; i < count; ++i) {
    locals.push_back(&state[i]);
    bodies.emplace_back([&body, i] { body(i); });
  }
  emu_run_fibers(bodies, locals);
}

// The running fiber's `Locals`, or the OS thread's own outside a launch.
template <typename Locals>
Locals& emu_locals_of() {
  static thread_local Locals host;
  return emu_fiber != nullptr ? *static_cast<Locals*>(emu_fiber->locals) : host;
}
"""
