// pybind11 bindings only: the runtime lives in runtime.cpp, the kernel in exchange.cu.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include <memory>
#include <stdexcept>

#include "exchange.cuh"
#include "launch.hpp"
#include "runtime.hpp"

namespace py = pybind11;
using ltxk::Runtime;

namespace {

// Runs f and turns C++ exceptions into Python ones *here*: std::invalid_argument -> ValueError, anything
// else -> RuntimeError, re-thrown as py::error_already_set, which pybind11's dispatcher restores without
// consulting the registered exception translators. Those translators live in pybind11's internals, which
// other extensions in the process (torch among them) may share with us; a C++ exception reaching them
// crashed the process on the GPU machine (torch 2.11), so no exception of ours ever gets that far.
template <typename F>
auto guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (py::error_already_set&) {
    throw;
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  throw py::error_already_set();
}

// The routes of make_plan as plain Python data, so CPU tests can replay the copy without a GPU.
py::dict plan_to_dict(int op, int world, const std::vector<int64_t>& counts, const std::vector<int>& src_ranks,
                      int64_t batch, const std::vector<int64_t>& seqs, int64_t heads_in, int64_t head_dim, int64_t itemsize,
                      int64_t capacity_bytes) {
  const ltxk::Plan plan = guarded([&] {
    return ltxk::make_plan(op, world, counts, src_ranks, batch, seqs, heads_in, head_dim, itemsize, capacity_bytes);
  });
  const ltxk::Params& p = plan.params;
  py::list routes;
  for (int i = 0; i < p.num_src; ++i) {
    const ltxk::Route& r = p.route[i];
    py::dict d;
    d["rank"] = r.rank;
    d["src_rows"] = r.src_rows;
    d["dst_row0"] = r.dst_row0;
    d["dst_col0"] = r.dst_col0;
    d["n_rows"] = std::vector<int32_t>(r.n_rows, r.n_rows + world);
    d["src_row0"] = std::vector<int32_t>(r.src_row0, r.src_row0 + world);
    d["src_col0"] = std::vector<int64_t>(r.src_col0, r.src_col0 + world);
    d["dst_rows"] = std::vector<int64_t>(r.dst_rows, r.dst_rows + world);
    routes.append(d);
  }
  py::dict out;
  out["batch"] = p.batch;
  out["chunk_bytes"] = p.chunk_bytes;
  out["src_stride"] = p.src_stride;
  out["dst_stride"] = p.dst_stride;
  out["out_bytes_max"] = plan.out_bytes_max;
  out["routes"] = routes;
  out["vector_bytes"] = ltxk::pick_vector_bytes(p, {});
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ltx-mgpu CUDA-IPC head exchange (raw pointers + stream handles; no torch dependency)";
  m.attr("MAX_RANKS") = ltxk::kMaxRanks;
  m.attr("CTRL_BYTES") = ltxk::kCtrlBytes;
  m.attr("THREADS") = ltxk::kThreads;
  m.attr("OP_SEND_RECV_HEADS") = static_cast<int>(ltxk::kSendRecvHeads);
  m.attr("OP_GATHER_HEADS") = static_cast<int>(ltxk::kGatherHeads);
  m.attr("OP_ALL_GATHER_HEADS") = static_cast<int>(ltxk::kAllGatherHeads);
  m.attr("PHASE_ENTRY") = static_cast<int>(ltxk::kPhaseEntry);
  m.attr("PHASE_EXIT") = static_cast<int>(ltxk::kPhaseExit);
  m.attr("CUDART_VERSION") = CUDART_VERSION;

  m.def("plan", &plan_to_dict, py::arg("op"), py::arg("world"), py::arg("counts"), py::arg("src_ranks"),
        py::arg("batch"), py::arg("seqs"), py::arg("heads_in"), py::arg("head_dim"), py::arg("itemsize"),
        py::arg("capacity_bytes"),
        "Host-only route computation of one exchange (raises ValueError exactly as a launch would).");
  m.def(
      "device_count",
      []() {
        int n = 0;
        return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
      },
      "CUDA devices visible to the extension's own runtime (0 when there is no driver).");
  m.def(
      "kernel_image_error",
      [](int device) -> py::object {
        // (the device stays current for the extension's runtime, as every entry point leaves it: runtime.cpp)
        cudaError_t err = cudaSetDevice(device);
        int blocks = 0;
        if (err == cudaSuccess) err = ltxk::exchange_blocks_per_sm(&blocks);
        if (err == cudaSuccess) return py::none();
        cudaGetLastError();  // (a failed load is not sticky; clear it so the next call starts clean)
        return py::str(cudaGetErrorString(err));
      },
      py::arg("device"),
      "None when the exchange kernel loads on `device` (this build has code for its architecture), else the CUDA "
      "runtime's reason (e.g. no kernel image for an sm_80 GPU when built for sm_90 and later).");

  py::class_<Runtime>(m, "Runtime")
      .def(py::init([](int device, int rank, int world, int64_t capacity_bytes, int64_t itemsize, double timeout_s,
                       bool loopback) {
             return guarded([&] {
               return std::make_unique<Runtime>(device, rank, world, capacity_bytes, itemsize, timeout_s, loopback);
             });
           }),
           py::arg("device"), py::arg("rank"), py::arg("world"), py::arg("capacity_bytes"), py::arg("itemsize"),
           py::arg("timeout_s"), py::arg("loopback"))
      .def("ipc_handle", [](const Runtime& r) { return py::bytes(guarded([&] { return r.ipc_handle(); })); })
      .def(
          "open_peers",
          [](Runtime& r, const std::vector<std::string>& handles, int blocks) {
            guarded([&] {
              py::gil_scoped_release nogil;
              r.open_peers(handles, blocks);
            });
          },
          py::arg("handles"), py::arg("blocks_per_src"))
      .def(
          "set_loopback_blocks", [](Runtime& r, int b) { guarded([&] { r.set_loopback_blocks(b); }); },
          py::arg("blocks_per_src"))
      .def(
          "set_rank_tokens", [](Runtime& r, const std::vector<int64_t>& c) { guarded([&] { r.set_rank_tokens(c); }); },
          py::arg("counts"))
      .def(
          "set_timeout", [](Runtime& r, double t) { guarded([&] { r.set_timeout(t); }); }, py::arg("timeout_s"))
      .def(
          "launch",
          [](Runtime& r, int op, const std::vector<uintptr_t>& srcs, int64_t batch, const std::vector<int64_t>& seqs,
             int64_t heads_in, int64_t head_dim, uintptr_t stream) {
            guarded([&] { r.launch(op, srcs, batch, seqs, heads_in, head_dim, stream); });
          },
          py::arg("op"), py::arg("srcs"), py::arg("batch"), py::arg("seqs"), py::arg("heads_in"), py::arg("head_dim"),
          py::arg("stream"))
      .def("error_state", &Runtime::error_state)
      .def("destroy",
           [](Runtime& r) {
             guarded([&] {
               py::gil_scoped_release nogil;
               r.destroy();
             });
           })
      .def(
          "data_ptr", [](const Runtime& r, int rank) { return guarded([&] { return r.data_ptr(rank); }); },
          py::arg("rank"))
      .def_property_readonly("device", &Runtime::device)
      .def_property_readonly("rank", &Runtime::rank)
      .def_property_readonly("world", &Runtime::world)
      .def_property_readonly("num_sms", &Runtime::num_sms)
      .def_property_readonly("blocks_per_sm", &Runtime::blocks_per_sm)
      .def_property_readonly("blocks_per_src", &Runtime::blocks_per_src)
      .def_property_readonly("capacity_bytes", &Runtime::capacity_bytes)
      .def_property_readonly("destroyed", &Runtime::destroyed)
      .def_property_readonly("ready", &Runtime::ready)
      .def_property_readonly("counts", &Runtime::counts);
}
