"""What an agent reports about its devices: NVML's names as spec gpu_types, the data sheet's
peaks, and on a CPU-only host slots with a peak measured at start."""

from __future__ import annotations

from infra.node_hardware import CPU, datasheet_peak, discover, gpu_type_slug, measured_in_a_child


def test_nvml_names_become_the_gpu_types_a_spec_names() -> None:
    assert gpu_type_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert gpu_type_slug("Tesla V100-SXM2-16GB") == "v100-sxm2-16gb"


def test_the_longest_matching_model_gives_the_peak() -> None:
    assert datasheet_peak("NVIDIA H100 PCIe") == 756e12  # not the SXM part's 989 TFLOP/s
    assert datasheet_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert datasheet_peak("NVIDIA A10G") == 70e12 and datasheet_peak("NVIDIA A10") == 125e12
    assert datasheet_peak("Some Future Accelerator") is None


def test_a_cpu_host_offers_slots_with_a_measured_peak() -> None:
    found = discover(slots=3, cpu_only=True)
    assert (found.gpus, found.gpu_type, found.peak_source) == (3, CPU, "measured")
    # One thread of any CPU that runs these tests does between 0.1 and 1000 GFLOP/s.
    assert 1e8 < found.peak_flops < 1e12, found
    assert found.memory_bytes > 2**30
    assert "3 CPU rank slots" in found.describe()


def test_a_peak_measured_in_a_quieter_moment_is_taken_as_it_is() -> None:
    found = discover(slots=2, cpu_only=True, measured_peak=5e10)
    assert (found.peak_flops, found.peak_source) == (5e10, "measured")


def test_a_peak_can_be_measured_in_a_child_process() -> None:
    """How an agent measures a GPU the data sheet does not know: in a process of its own, so it
    never holds a CUDA context itself (here on the CPU, the one device this machine has)."""
    measured = measured_in_a_child("cpu")
    assert 1e8 < measured < 1e12, measured
