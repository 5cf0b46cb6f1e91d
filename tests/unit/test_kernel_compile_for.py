"""horovod_quant.backends.cuda.kernels.compile_for: the kernels compiled with NVRTC for a named
architecture on a machine without a GPU (the GPU image's build check runs it). The compile needs
CuPy with its NVRTC library and skips without them; the argument check needs neither."""
import pytest

from horovod_quant.backends.cuda import kernels


def _nvrtc_or_skip():
    pytest.importorskip("cupy")
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # CuPy without its NVRTC library
        pytest.skip(f"NVRTC not loadable through CuPy: {exc!r}")


@pytest.mark.parametrize("arch", ["90", "sm90", "sm_", "compute_x", "gfx90a", "sm_90 "])
def test_an_architecture_that_is_not_nvrtcs_is_refused_before_any_compile(arch):
    with pytest.raises(ValueError, match="'sm_90'"):
        kernels.compile_for(arch)


@pytest.mark.parametrize("arch, kind, magic", [("sm_90", ".cubin", b"\x7fELF"),
                                               ("compute_80", ".ptx", b"//")])
def test_every_kernel_file_compiles_for_the_architecture_without_asking_a_device(
        arch, kind, magic, monkeypatch, tmp_path):
    _nvrtc_or_skip()
    from horovod_quant.backends.cuda.source import KERNEL_FILES

    def no_device():
        raise AssertionError("compile_for asked for the current device")

    monkeypatch.setattr(kernels, "_targets", no_device)
    monkeypatch.setenv("HQ_KERNEL_CACHE", str(tmp_path))
    paths = kernels.compile_for(arch)
    assert [p.name.split(f"_{arch}_")[0] for p in paths] == [f[:-3] for f in KERNEL_FILES]
    for path in paths:
        assert path.parent == tmp_path and path.suffix == kind
        assert path.read_bytes().startswith(magic)
    stamps = [p.stat().st_mtime_ns for p in paths]
    assert kernels.compile_for(arch) == paths  # the second call finds them in the cache
    assert [p.stat().st_mtime_ns for p in paths] == stamps
