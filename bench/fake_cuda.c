/* A stand-in for the CUDA driver (libcuda.so.1) for bench/mosaic_cubin.py: JAX's CUDA plugin compiles a Mosaic GPU
   kernel for the compute capability the driver reports, and asks the driver nothing else before the cubin. This
   reports one device of compute capability FAKE_CUDA_CC (90: sm_90a, 100: sm_100a) and has no other entry point,
   so anything that would touch a device fails. Built by make compile-check: cc -shared -fPIC -o libcuda.so.1 */
#include <stdlib.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;

enum { SUCCESS = 0, ATTRIBUTE_CC_MAJOR = 75, ATTRIBUTE_CC_MINOR = 76 };

static int compute_capability(void) {
  const char *cc = getenv("FAKE_CUDA_CC");
  return cc ? atoi(cc) : 90;
}

CUresult cuInit(unsigned flags) { return SUCCESS; }
CUresult cuDriverGetVersion(int *version) { *version = 13000; return SUCCESS; }
CUresult cuDeviceGetCount(int *count) { *count = 1; return SUCCESS; }
CUresult cuDeviceGet(CUdevice *device, int ordinal) { *device = 0; return SUCCESS; }
CUresult cuCtxGetDevice(CUdevice *device) { *device = 0; return SUCCESS; }

CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) {
  *value = attribute == ATTRIBUTE_CC_MAJOR ? compute_capability() / 10
         : attribute == ATTRIBUTE_CC_MINOR ? compute_capability() % 10
         : 0;
  return SUCCESS;
}

CUresult cuGetErrorString(CUresult result, const char **text) {
  *text = "bench/fake_cuda.c: no device";
  return SUCCESS;
}

CUresult cuGetErrorName(CUresult result, const char **text) {
  *text = "CUDA_ERROR_NO_DEVICE";
  return SUCCESS;
}
