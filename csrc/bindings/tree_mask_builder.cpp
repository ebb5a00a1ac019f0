#include "decode/tree_mask_builder.h"

#include <pybind11/stl.h>

#include "bindings/bindings.h"

namespace py = pybind11;

namespace mtprobe::bindings {

void bind_tree_mask_builder(py::module_& m) {
  py::class_<TreeMaskBuilder>(m, "TreeMaskBuilder",
                              "The decode loop's attention mask and position ids of one draft block "
                              "(csrc/decode/tree_mask_builder.h), for inspection and tests.")
      .def(py::init([](int64_t capacity, const std::string& mask_dtype, const std::string& device,
                       bool incremental, bool ancestor_bits) {
             return std::make_unique<TreeMaskBuilder>(capacity, parse_mask_dtype(mask_dtype),
                                                      at::Device(device), incremental, ancestor_bits);
           }),
           py::arg("capacity"), py::arg("mask_dtype") = "float32", py::arg("device") = "cpu",
           py::arg("incremental") = true, py::arg("ancestor_bits") = false)
      .def(
          "build",
          [](TreeMaskBuilder& b, const std::vector<int64_t>& parents, int64_t prefix_len) {
            BlockInputs in = b.build(parents, prefix_len);
            return py::make_tuple(in.position_ids, in.mask ? py::cast(*in.mask) : py::none());
          },
          py::arg("parents"), py::arg("prefix_len"),
          "(position_ids [1, T], mask [1, 1, T, P + T] additive, [1, 1, T, ceil(T / 64)] ancestor bits, "
          "or None for a chain)")
      .def_property_readonly("rebuilds", &TreeMaskBuilder::rebuilds)
      .def_property_readonly("capacity", &TreeMaskBuilder::capacity);
}

}  // namespace mtprobe::bindings
