"""Import before the kernels when running them under TRITON_INTERPRET=1 (the CPU tests' scripts).

Triton 3.6's interpreter converts a 1-element scalar to an int with ``int(array)``, an error since
numpy 2.3, so every loop with a run-time bound fails ("only 0-dimensional arrays can be converted
to Python scalars"); importing this module makes it convert through the array's one element."""
from triton.runtime import interpreter

_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_with_item(tensor, scope):
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


if getattr(interpreter._patch_lang_tensor, "__name__", "") != "_patch_with_item":
    interpreter._patch_lang_tensor = _patch_with_item
