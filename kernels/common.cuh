// Shared helpers of the generated convolution kernels (included into every kernel source).

// Sum of v over the 32 lanes of a warp; every lane gets the result. Fixed order: deterministic.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
