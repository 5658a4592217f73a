"""Lets PyPI's torchvision import beside a CPU-only torch (installed by scripts/install_torchvision.sh).

PyPI's Linux torchvision wheels are CUDA builds: beside torch's ``+cpu`` build their C++ ops library does not load,
which torchvision tolerates everywhere but in two fake-kernel registrations (``torchvision::nms`` and
``torchvision::qnms`` in ``torchvision/_meta_registrations.py``, unguarded up to 0.29; pytorch/vision#9085, fixed by
pytorch/vision#9649) that then fail the import with "operator torchvision::nms does not exist". transformers needs
torchvision to build a Qwen-VL processor (its video processor), so vime's vision-language support does too.

A ``.pth`` file imports this module at interpreter start-up; it adds an import hook that acts once, when
``torchvision`` is first imported: it tries torchvision's ops library, and only if that does not load it declares
the two ops' schemas (no kernels) so the registrations succeed. The image transforms transformers uses are plain
torch; a call of ``torchvision.ops.nms`` still fails with torchvision's own "Couldn't load custom C++ ops" error.
Costs nothing in a process that never imports torchvision. docs/vlm.md, "torchvision on the CPU".
"""

import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import PathFinder

_LIBRARY = None  # the torch.library.Library holding the declared schemas (kept alive for the process)


class _TorchvisionOps(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 - the importlib protocol
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = PathFinder.find_spec(name, path)
        if spec is not None and spec.submodule_search_locations:
            _declare_missing_ops(list(spec.submodule_search_locations)[0])
        return spec


def _declare_missing_ops(package_dir: str) -> None:
    global _LIBRARY
    import glob

    import torch

    for lib in glob.glob(package_dir + "/_C*.so"):
        try:
            torch.ops.load_library(lib)
            return  # the ops load: a matching build, nothing to do
        except OSError:
            pass
    _LIBRARY = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        _LIBRARY.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


if not any(isinstance(f, _TorchvisionOps) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionOps())
