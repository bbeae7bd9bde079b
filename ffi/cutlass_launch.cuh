#pragma once
// Preparing and launching a CUTLASS SM90 kernel from the unit that compiled it.
//
// nvcc gives every unit its own host stub of cutlass::device_kernel<Kernel> (a local
// symbol), while the member functions of a class template are weak and the linker keeps one
// unit's copy. Two units may compile the same kernel (the grouped weight gradient's E4M3 x
// E4M3 kernels are the grouped GEMM's): a shared-memory limit raised through one unit's stub
// does not reach the kernel launched through the other's, and that launch fails
// (cudaErrorInvalidValue). So everything here has internal linkage (an unnamed namespace), the
// configuration headers put their class templates in one too, and kernels are launched here,
// not through GemmUniversalAdapter::run (a weak function the linker may take from another
// unit, which also clears the launch's error before it returns its own status).
#include <cstdint>
#include <mutex>

#include <cuda_runtime.h>

#include "cutlass/device_kernel.h"
#include "cutlass/kernel_hardware_info.h"

namespace jax_fp8 {
namespace sm90 {
namespace {

constexpr int kMaxDevices = 64;

// One CUTLASS kernel on the devices of this process.
template <class Kernel>
struct KernelOnDevice {
  static inline std::mutex mu;
  static inline cutlass::KernelHardwareInfo hw[kMaxDevices];  // sm_count 0: not prepared

  // Once per device, before the first launch and before any stream capture (XLA's
  // initialize stage): the kernel's dynamic shared-memory limit raised to what it uses, and
  // the hardware facts its tile scheduler sizes the persistent grid from. 0 or a cudaError_t.
  static int Prepare(int32_t device) {
    if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
    std::lock_guard<std::mutex> lock(mu);
    if (hw[device].sm_count > 0) return 0;
    int current = -1;
    cudaGetDevice(&current);
    if (current != device) cudaSetDevice(device);
    int err = 0;
    const int smem = static_cast<int>(Kernel::SharedStorageSize);
    if (smem >= (48 << 10)) {
      err = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    }
    cutlass::KernelHardwareInfo info{};
    if (err == 0) info = cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(device);
    if (current != device && current >= 0) cudaSetDevice(current);
    if (err == 0 && info.sm_count <= 0) err = cudaErrorInvalidDevice;
    if (err == 0) hw[device] = info;
    return err;
  }

  // Enqueues the kernel (prepared on this device) on `stream`; 0 or the launch's
  // cudaError_t, as the runtime reported it.
  static int Launch(const typename Kernel::Params& params, cudaStream_t stream) {
    const dim3 grid = Kernel::get_grid_shape(params);
    const dim3 block = Kernel::get_block_shape();
    cutlass::device_kernel<Kernel>
        <<<grid, block, static_cast<size_t>(Kernel::SharedStorageSize), stream>>>(params);
    return static_cast<int>(cudaGetLastError());
  }
};

}  // namespace
}  // namespace sm90
}  // namespace jax_fp8
