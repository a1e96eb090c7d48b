"""A transformers model config's values without its class, for the processes the engine spawns.

Unpickling a ``transformers.PretrainedConfig`` imports its ``configuration_<arch>`` module and,
through it, transformers' model-loading stack (``torch.distributed.tensor``, sympy,
accelerate): about 3 s of CPU per process on the 2-core CI machine, paid by every engine core,
tensor- / pipeline-parallel worker and Ray actor, none of which needs transformers otherwise.
``ModelConfig`` and ``SpeculativeConfig`` pickle their HF configs as ``HFConfigView``.

No I/O happens at import; nothing here imports torch or transformers.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any


class HFConfigView:
    """Every non-callable attribute of a ``transformers.PretrainedConfig``, read once.

    The values are read through the config itself, so properties and ``attribute_map``
    aliases (``rope_scaling``, ``n_head`` ...) give what the config gives. Nested configs
    (``text_config``, ``vision_config``) become views too, in dicts and lists as well; classes
    and other transformers objects are left out. A method of the config (``to_dict``,
    ``get_text_config``) is not available: calling one raises ``AttributeError``.

    Args:
        values: attribute name -> value (use :meth:`of` to build one from a config).
    """

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    @classmethod
    def of(cls, config: Any) -> Any:
        """``config`` as a view; ``None`` and a view are returned as they are."""
        if config is None or isinstance(config, HFConfigView):
            return config
        hf_logger = logging.getLogger("transformers")
        level = hf_logger.level
        hf_logger.setLevel(logging.ERROR)  # deprecated aliases (torch_dtype ...) warn when read
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                values = _values(config)
        finally:
            hf_logger.setLevel(level)
        return cls(values)

    def __repr__(self) -> str:
        return f"HFConfigView(model_type={getattr(self, 'model_type', None)!r})"


_SKIP = object()


def _values(config: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    aliases = getattr(config, "attribute_map", None) or {}  # resolved by the config's __getattribute__, not in dir()
    for name in [*dir(config), *aliases]:
        if name.startswith("__"):
            continue
        try:
            value = getattr(config, name)
        except Exception:  # noqa: BLE001 - a property that does not apply to this config
            continue
        value = _viewed(value)
        if value is not _SKIP:
            values[name] = value
    return values


def _is_hf_config(value: Any) -> bool:
    return any(c.__name__ in ("PretrainedConfig", "PreTrainedConfig") and c.__module__.startswith("transformers")
               for c in type(value).__mro__)


def _viewed(value: Any) -> Any:
    """``value`` with every HF config in it as a view; ``_SKIP`` for what must not travel."""
    if isinstance(value, (str, int, float, bool, type(None), HFConfigView)):
        return value
    if _is_hf_config(value):
        return HFConfigView.of(value)
    if isinstance(value, (list, tuple)):
        items = [_viewed(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else type(value)(items)
    if isinstance(value, dict):
        items = {k: _viewed(v) for k, v in value.items()}
        return _SKIP if any(v is _SKIP for v in items.values()) else items
    if callable(value) or type(value).__module__.split(".")[0] == "transformers":
        return _SKIP
    return value
