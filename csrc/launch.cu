// Process-wide launch settings of the csrc kernels: whether they use programmatic dependent
// launch (common.cuh, lsq_launch); and whether they can run on this machine at all.

#include <atomic>

#include "common.cuh"

namespace {

std::atomic<int> g_pdl{1};                  // wanted: 1 on (where supported), 0 off
std::atomic<uint64_t> g_known{0}, g_sm90{0};  // a bit per device: capability read, and >= 9.0

}  // namespace

namespace lsq_image {

// Loaded by lsq_probe, never launched: every kernel of the library is built for the same
// architectures, so whether this one's image loads on a device says it for all of them.
__global__ void probe_kernel() {}

}  // namespace lsq_image

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

// Whether this library's kernels can run on the calling thread's current device: the
// cudaError_t of loading a kernel's image there (0: they can). A library that loads and whose
// launches then all fail is what a GPU older than sm_80 (no image), or a driver older than the
// CUDA runtime linked in (cudaErrorInsufficientDriver), would otherwise give at the first
// step; the caller picks another backend instead. Also reports the linked runtime's version
// and the driver's (0: no driver), e.g. 13000 for CUDA 13.0.
int lsq_probe(int32_t* runtime_version, int32_t* driver_version) {
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  *runtime_version = runtime;
  *driver_version = driver;
  cudaFuncAttributes attributes;
  const cudaError_t err = cudaFuncGetAttributes(&attributes, lsq_image::probe_kernel);
  cudaGetLastError();  // not sticky, but leave nothing for torch's next check to report
  return (int)err;
}

// cudaGetErrorName of a status the entry points returned ("cudaErrorInsufficientDriver").
const char* lsq_error_name(int32_t status) { return cudaGetErrorName((cudaError_t)status); }

}  // extern "C"
