// mtprobe._C: the torch ops register themselves on load (csrc/ops/registration.cpp); this module
// adds the stateful host objects.
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"
#include "ops/ops.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "mtprobe C++ core: drafters and the decode loop (tensor ops live in torch.ops.mtprobe)";
  // c10 errors carry a C++ backtrace in what(); users need the message, typed like Python's.
  pybind11::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });
  mtprobe::bindings::bind_topology(m);  // before the drafters: MaskProbeDrafter takes a bank
  mtprobe::bindings::bind_drafters(m);
  mtprobe::bindings::bind_schedule(m);  // after the drafters: AutoDrafter is one
  mtprobe::bindings::bind_decode_loop(m);
  mtprobe::bindings::bind_quantized_decoder(m);
  mtprobe::bindings::bind_target_forward(m);
  m.def("small_batch_linear_simd", &mtprobe::ops::small_batch_linear_simd,
        "Whether torch.ops.mtprobe.small_batch_linear runs a SIMD kernel (AVX2/FMA at least) on this CPU "
        "(otherwise a portable scalar loop, slower than torch's own linear)");
  m.def("small_batch_linear_isa", &mtprobe::ops::small_batch_linear_isa,
        "The kernel torch.ops.mtprobe.small_batch_linear runs on this CPU: 'avx2' or 'scalar'");
  m.def("panel_linear_isa", &mtprobe::ops::panel_linear_isa,
        "The kernel torch.ops.mtprobe.panel_linear (the C++ target forward's) runs on this CPU: 'avx512', "
        "'avx2' or 'scalar'");
  m.def("quantized_linear_isa", &mtprobe::ops::quantized_linear_isa,
        "The kernel torch.ops.mtprobe.quantized_linear runs on this CPU: 'avx512', 'avx2' or 'scalar'");
  m.def("quantized_linear_int8_isa", &mtprobe::ops::quantized_linear_int8_isa,
        "The kernel torch.ops.mtprobe.quantized_linear_int8 runs on this CPU: 'avx512_vnni', 'avx2' or "
        "'scalar'");
  mtprobe::bindings::bind_testing(m);  // last: its functions take NgramMemory, AcceptanceStats, CostTable
}
