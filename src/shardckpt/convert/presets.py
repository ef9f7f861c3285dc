"""Name presets: the original google-research TF BERT layout to Hugging Face transformers.

``bert``: the checkpoints of google-research/bert (``bert/encoder/layer_0/attention/
self/query/kernel`` ...) to the state dict of ``transformers.BertForPreTraining``
(``bert.encoder.layer.0.attention.self.query.weight`` ...):

* ``layer_N`` -> ``layer.N``; ``/`` -> ``.``;
* ``kernel`` -> ``weight``, **transposed** (TF dense kernels are ``[in, out]``, torch
  ``Linear`` weights ``[out, in]``); ``gamma`` -> ``weight``; ``beta`` -> ``bias``;
* ``*_embeddings`` tables get ``.weight``; ``output_bias`` -> ``bias``,
  ``output_weights`` -> ``weight`` (already ``[out, in]``), ``squad`` -> ``classifier``;
* ``cls/predictions/output_bias`` -> ``cls.predictions.bias``;
* optimizer slots (``adam_m``, ``adam_v``, ``AdamWeightDecayOptimizer*``) and
  ``global_step`` are left out.

``electra``: the same rules for ELECTRA's discriminator (``transformers.ElectraForPreTraining``):
``electra/...`` and ``discriminator_predictions/...`` (whose ``dense_1`` is ``dense_prediction``);
the generator's variables (``generator/``, ``generator_predictions/``) and ``temperature``
are left out.

:func:`bert_config` turns a ``bert_config.json`` into a transformers ``config.json``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Dict, Optional, Tuple

from ..errors import InvalidArgumentError

__all__ = ["PRESETS", "bert_name", "electra_name", "bert_config"]

_SKIP = {"adam_v", "adam_m", "AdamWeightDecayOptimizer", "AdamWeightDecayOptimizer_1", "global_step"}
_LAYER = re.compile(r"^layer_(\d+)$")


def bert_name(name: str) -> Optional[Tuple[str, bool]]:
    """The ``BertForPreTraining`` name of a TF BERT variable and whether it is transposed (None: left out)."""
    parts = name.split("/")
    if any(p in _SKIP for p in parts) or name.startswith("_CHECKPOINTABLE"):
        return None
    out = []
    transpose = False
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        m = _LAYER.match(part)
        if m:
            out += ["layer", m.group(1)]
        elif last and part == "kernel":
            out.append("weight")
            transpose = True
        elif last and part in ("gamma", "output_weights"):
            out.append("weight")
        elif last and part in ("beta", "output_bias"):
            out.append("bias")
        elif part == "squad":
            out.append("classifier")
        else:
            out.append(part)
            if last and part.endswith("_embeddings"):
                out.append("weight")
    return ".".join(out), transpose


def electra_name(name: str) -> Optional[Tuple[str, bool]]:
    """The ``ElectraForPreTraining`` (discriminator) name of an ELECTRA TF variable (None: left out)."""
    parts = name.split("/")
    if parts[0] in ("generator", "generator_predictions") or "temperature" in parts:
        return None
    return bert_name("/".join("dense_prediction" if p == "dense_1" else p for p in parts))


def bert_config(text: str, architecture: str = "BertForPreTraining", model_type: str = "bert") -> Dict[str, Any]:
    """A transformers ``config.json`` (as a dict) from the text of a google-research ``bert_config.json``."""
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise InvalidArgumentError(f"bert_config.json is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidArgumentError("bert_config.json is not a JSON object")
    out = dict(config)
    out.setdefault("layer_norm_eps", 1e-12)
    out.setdefault("pad_token_id", 0)
    out["model_type"] = model_type
    out["architectures"] = [architecture]
    return out


PRESETS: Dict[str, Tuple[Callable[[str], Optional[Tuple[str, bool]]], str, str]] = {
    # name: (rename rule, transformers architecture, model_type)
    "bert": (bert_name, "BertForPreTraining", "bert"),
    "electra": (electra_name, "ElectraForPreTraining", "electra"),
}
