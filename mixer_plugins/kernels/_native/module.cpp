// The Python module the kernels are built into (mixer_plugins.kernels._native._C): importing it loads the library,
// whose TORCH_LIBRARY fragments register torch.ops.mixer_plugins_native; the module itself holds nothing.

#include <Python.h>

#include "common.h"

namespace {
// The float32 lanes of the vector code this build runs (1: scalar loops only).
int64_t vector_lanes() {
#ifdef MIXER_PLUGINS_NATIVE_VECTOR
  return mixer_plugins_native::kLanes;
#else
  return 1;
#endif
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(mixer_plugins_native, m) { m.def("vector_lanes() -> int", &vector_lanes); }

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
