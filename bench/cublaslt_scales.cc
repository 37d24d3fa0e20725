// cuBLASLt's FP8 (E4M3 x E4M3 -> bf16) GEMM on Hopper under each of its scale modes: per tensor (what XLA
// calls, the `fp8` backend's GEMM), per row and column (OUTER_VEC_32F), per row and 128-element K chunk
// (VEC128_32F, DeepSeek-V3's fine-grained scaling) and 128 x 128 blocks (BLK128x128_32F). A GEMM of the third
// kind would let the MXFP4 quantizers write E4M3 bytes themselves (docs/BENCHMARKS.md, "Session of 2026-12-06,
// 16:12 UTC", which holds this probe's table). It checks the VEC128 layout on two small products against a
// float64 reference first, then times each mode at the Llama-1B and Llama-3-8B GEMM shapes, best of up to 16
// of cuBLASLt's heuristic algorithms (the first one's time in parentheses).
//
// Y[M, N] (row-major) = sum_k X[M, k] W[N, k] x factors, both operands K-contiguous (TN). In cuBLAS's
// column-major terms: A = W (K x N, op T), B = X (K x M, op N), D = N x M (Y row-major).
//
// Build (no GPU needed; headers and libraries of the CUDA 13 wheels that jax[cuda13] installs):
//   NV=$(python3 -c "import nvidia; print(list(nvidia.__path__)[0])")/cu13
//   LIBS="-l:libcublasLt.so.13 -l:libcudart.so.13"
//   g++ -O2 -std=c++17 -o /tmp/cublaslt_scales bench/cublaslt_scales.cc -I$NV/include -L$NV/lib $LIBS
// Run on the GPU: LD_LIBRARY_PATH=$NV/lib /tmp/cublaslt_scales [timed calls per algorithm, default 20]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CK(x)                                                              \
  do {                                                                     \
    cudaError_t e = (x);                                                   \
    if (e != cudaSuccess) {                                                \
      printf("CUDA error %s at line %d\n", cudaGetErrorString(e), __LINE__); \
      exit(1);                                                             \
    }                                                                      \
  } while (0)
#define LT(x)                                                              \
  do {                                                                     \
    cublasStatus_t s = (x);                                                \
    if (s != CUBLAS_STATUS_SUCCESS) {                                      \
      printf("cuBLASLt status %d at line %d\n", (int)s, __LINE__);         \
      return -1.0;                                                         \
    }                                                                      \
  } while (0)

static float e4m3_value(uint8_t b) {
  int e = (b >> 3) & 15, m = b & 7;
  float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
  return (b >> 7) ? -v : v;
}

static uint8_t e4m3_byte(float v) {  // v must be an E4M3 value (the check draws them from E2M1's grid)
  for (int b = 0; b < 256; ++b)
    if ((b & 0x7f) != 0x7f && e4m3_value(b) == v) return (uint8_t)b;
  printf("%g is no E4M3 value\n", v);
  exit(1);
}

static float bf16_value(__nv_bfloat16 h) {
  uint16_t u;
  memcpy(&u, &h, 2);
  uint32_t w = (uint32_t)u << 16;
  float f;
  memcpy(&f, &w, 4);
  return f;
}

struct Mode {
  const char* name;
  cublasLtMatmulMatrixScale_t w, x;  // the scale modes of cuBLAS's A (= W) and B (= X)
  bool fast_accum;                   // CUBLASLT_MATMUL_DESC_FAST_ACCUM (the block modes refuse it)
};

static const Mode MODES[] = {
    {"scalar, fast accum", CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, true},
    {"scalar", CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, false},
    {"outer vec, fast accum", CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F,
     true},
    {"outer vec", CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, false},
    {"vec128", CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, false},
    {"W blk128, X vec128", CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
     false},
    {"W vec128, X blk128", CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
     false},
};
static const Mode& VEC128 = MODES[4];

static cublasLtHandle_t lt;
static void* workspace;
static const size_t WORKSPACE = 64u << 20;

struct Operands {
  const uint8_t *x, *w;  // [M, K] and [N, K], E4M3
  const float *sx, *sw;  // their factors, laid out as the mode asks
  __nv_bfloat16* y;      // [M, N]
};

// Y = X W^T under `mode`: the best time in us over up to 16 heuristic algorithms (the first one's in *first),
// or -1 where cuBLASLt has none. Leaves the first algorithm's result in op.y.
static double gemm(int M, int N, int K, const Mode& mode, const Operands& op, int iters, double* first) {
  cublasLtMatmulDesc_t desc;
  LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  int8_t fast = mode.fast_accum;
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode.w, sizeof mode.w));
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode.x, sizeof mode.x));
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &op.sw, sizeof op.sw));
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &op.sx, sizeof op.sx));
  cublasLtMatrixLayout_t la, lb, ld;
  LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, N, K));
  LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, M, K));
  LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, N, M, N));
  cublasLtMatmulPreference_t pref;
  LT(cublasLtMatmulPreferenceCreate(&pref));
  size_t bytes = WORKSPACE;
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof bytes));
  cublasLtMatmulHeuristicResult_t found[16];
  int count = 0;
  cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 16, found, &count);
  double best = -1.0;
  *first = -1.0;
  float alpha = 1.f, beta = 0.f;
  auto call = [&](int i) {
    return cublasLtMatmul(lt, desc, &alpha, op.w, la, op.x, lb, &beta, op.y, ld, op.y, ld, &found[i].algo, workspace,
                          WORKSPACE, 0);
  };
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  for (int i = 0; status == CUBLAS_STATUS_SUCCESS && i < count; ++i) {
    if (call(i) != CUBLAS_STATUS_SUCCESS) continue;
    CK(cudaStreamSynchronize(0));
    CK(cudaEventRecord(start));
    for (int r = 0; r < iters; ++r) call(i);
    CK(cudaEventRecord(stop));
    CK(cudaEventSynchronize(stop));
    float ms;
    CK(cudaEventElapsedTime(&ms, start, stop));
    double us = 1000.0 * ms / iters;
    if (i == 0) *first = us;
    best = best < 0 ? us : std::min(best, us);
  }
  if (best >= 0) call(0);
  CK(cudaStreamSynchronize(0));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
  return best;
}

// One element of Y under VEC128 factors laid out row-contiguous (factor[c * rows + r], what cuBLASLt reads) or
// chunk-contiguous (factor[r * chunks + c]), in float64.
static double vec128_reference(int i, int j, int M, int N, int K, const std::vector<uint8_t>& X,
                               const std::vector<uint8_t>& W, const std::vector<float>& sx,
                               const std::vector<float>& sw, bool chunk_contiguous) {
  int chunks = (K + 127) / 128;
  double y = 0;
  for (int c = 0; c < chunks; ++c) {
    double partial = 0;
    for (int k = c * 128; k < std::min(K, c * 128 + 128); ++k)
      partial += (double)e4m3_value(X[(size_t)i * K + k]) * e4m3_value(W[(size_t)j * K + k]);
    float fx = chunk_contiguous ? sx[(size_t)i * chunks + c] : sx[(size_t)c * M + i];
    float fw = chunk_contiguous ? sw[(size_t)j * chunks + c] : sw[(size_t)c * N + j];
    y += partial * fx * fw;
  }
  return y;
}

// VEC128 on random E4M3 operands and power-of-two factors: the largest difference from each layout's reference
// (the right one is within bf16's rounding of the largest |y|).
static void check_vec128(int M, int N, int K) {
  std::mt19937 rng(1);
  const float grid[] = {0.5f, 1, 1.5f, 2, 3, 4, 6};
  auto draw = [&]() { return e4m3_byte(grid[rng() % 7] * ldexpf(1, (int)(rng() % 5)) * ((rng() & 1) ? -1 : 1)); };
  std::vector<uint8_t> X((size_t)M * K), W((size_t)N * K);
  for (auto& b : X) b = draw();
  for (auto& b : W) b = draw();
  int chunks = (K + 127) / 128;
  std::vector<float> sx((size_t)M * chunks), sw((size_t)N * chunks);
  for (auto& f : sx) f = ldexpf(1, (int)(rng() % 9) - 4);
  for (auto& f : sw) f = ldexpf(1, (int)(rng() % 9) - 4);
  uint8_t *x, *w;
  float *fx, *fw;
  __nv_bfloat16* y;
  CK(cudaMalloc(&x, X.size()));
  CK(cudaMalloc(&w, W.size()));
  CK(cudaMalloc(&fx, sx.size() * 4));
  CK(cudaMalloc(&fw, sw.size() * 4));
  CK(cudaMalloc(&y, (size_t)M * N * 2));
  CK(cudaMemcpy(x, X.data(), X.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w, W.data(), W.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(fx, sx.data(), sx.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(fw, sw.data(), sw.size() * 4, cudaMemcpyHostToDevice));
  double first;
  if (gemm(M, N, K, VEC128, {x, w, fx, fw, y}, 1, &first) < 0) {
    printf("check %d x %d x %d: cuBLASLt has no VEC128 algorithm\n", M, N, K);
  } else {
    std::vector<__nv_bfloat16> Y((size_t)M * N);
    CK(cudaMemcpy(Y.data(), y, Y.size() * 2, cudaMemcpyDeviceToHost));
    double err[2] = {0, 0}, largest = 0;
    for (int i = 0; i < M; i += std::max(1, M / 16))
      for (int j = 0; j < N; j += std::max(1, N / 16)) {
        for (int layout = 0; layout < 2; ++layout) {
          double ref = vec128_reference(i, j, M, N, K, X, W, sx, sw, layout);
          err[layout] = std::max(err[layout], fabs(bf16_value(Y[(size_t)i * N + j]) - ref));
          if (layout == 0) largest = std::max(largest, fabs(ref));
        }
      }
    printf("check %d x %d x %d, VEC128: largest error %.4g with row-contiguous factors, %.4g with "
           "chunk-contiguous ones (largest |y| %.4g)\n", M, N, K, err[0], err[1], largest);
  }
  cudaFree(x);
  cudaFree(w);
  cudaFree(fx);
  cudaFree(fw);
  cudaFree(y);
}

int main(int argc, char** argv) {
  cudaDeviceProp props;
  CK(cudaGetDeviceProperties(&props, 0));
  printf("device %s, cuBLASLt %d\n", props.name, (int)cublasLtGetVersion());
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) {
    printf("cuBLASLt did not start\n");
    return 1;
  }
  CK(cudaMalloc(&workspace, WORKSPACE));
  check_vec128(256, 384, 512);
  check_vec128(200, 136, 384);
  struct Shape {
    const char* name;
    int M, N, K;
  } shapes[] = {
      {"1B gate|up fprop", 16384, 16384, 2048}, {"1B down fprop", 16384, 2048, 8192},
      {"1B gate|up dgrad", 16384, 2048, 16384}, {"1B gate|up wgrad", 2048, 16384, 16384},
      {"1B q|k|v fprop", 16384, 3072, 2048},    {"8B gate|up fprop", 8192, 28672, 4096},
      {"8B down fprop", 8192, 4096, 14336},     {"8B gate|up wgrad", 4096, 28672, 8192},
      {"8B down dgrad", 8192, 14336, 4096},
  };
  int iters = argc > 1 ? atoi(argv[1]) : 20;
  printf("\n| product | M x N x K |");
  for (const Mode& mode : MODES) printf(" %s, us |", mode.name);
  printf("\n");
  for (const Shape& s : shapes) {
    size_t factors = (size_t)std::max(s.M, s.N) * ((s.K + 127) / 128);  // the most any mode reads
    uint8_t *x, *w;
    float *fx, *fw;
    __nv_bfloat16* y;
    CK(cudaMalloc(&x, (size_t)s.M * s.K));
    CK(cudaMalloc(&w, (size_t)s.N * s.K));
    CK(cudaMalloc(&y, (size_t)s.M * s.N * 2));
    CK(cudaMalloc(&fx, factors * 4));
    CK(cudaMalloc(&fw, factors * 4));
    CK(cudaMemset(x, 0x38, (size_t)s.M * s.K));  // 1.0
    CK(cudaMemset(w, 0x30, (size_t)s.N * s.K));  // 0.5
    std::vector<float> ones(factors, 1.0f);
    CK(cudaMemcpy(fx, ones.data(), factors * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(fw, ones.data(), factors * 4, cudaMemcpyHostToDevice));
    printf("| %s | %d x %d x %d |", s.name, s.M, s.N, s.K);
    for (const Mode& mode : MODES) {
      double first, best = gemm(s.M, s.N, s.K, mode, {x, w, fx, fw, y}, iters, &first);
      if (best < 0)
        printf(" none |");
      else
        printf(" %.1f (%.1f) |", best, first);
      fflush(stdout);
    }
    printf("\n");
    cudaFree(x);
    cudaFree(w);
    cudaFree(y);
    cudaFree(fx);
    cudaFree(fw);
  }
  return 0;
}
