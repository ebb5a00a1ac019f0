// pybind11 bindings, one file per concept of the core (drafters, decode loop).
#pragma once

#include <torch/extension.h>

namespace mtprobe::bindings {
void bind_drafters(pybind11::module_& m);
void bind_decode_loop(pybind11::module_& m);
void bind_schedule(pybind11::module_& m);
void bind_topology(pybind11::module_& m);
}  // namespace mtprobe::bindings
