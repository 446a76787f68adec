// Process-wide launch settings of the csrc kernels: whether they use programmatic dependent
// launch (common.cuh, lsq_launch). Host code only.

#include <atomic>

#include "common.cuh"

namespace {

std::atomic<int> g_pdl{1};                  // wanted: 1 on (where supported), 0 off
std::atomic<uint64_t> g_known{0}, g_sm90{0};  // a bit per device: capability read, and >= 9.0

}  // namespace

bool lsq_pdl_active() {
  if (!g_pdl.load(std::memory_order_relaxed)) return false;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= 64) return false;
  const uint64_t bit = uint64_t{1} << dev;
  if (!(g_known.load(std::memory_order_relaxed) & bit)) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
      return false;
    if (major >= 9) g_sm90.fetch_or(bit, std::memory_order_relaxed);
    g_known.fetch_or(bit, std::memory_order_relaxed);
  }
  return (g_sm90.load(std::memory_order_relaxed) & bit) != 0;
}

extern "C" {

// Programmatic dependent launch for the launches that follow, in this process: 1 on (on sm_90
// and newer GPUs; the default), 0 off; anything else only asks. Returns the setting before.
int32_t lsq_programmatic_launch(int32_t on) {
  const int before = g_pdl.load();
  if (on == 0 || on == 1) g_pdl.store(on);
  return before;
}

}  // extern "C"
