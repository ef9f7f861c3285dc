"""Name presets: the original google-research TF BERT-family layouts to Hugging Face transformers.

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

``albert``: google-research/albert checkpoints to ``transformers.AlbertForPreTraining``. ALBERT
shares one set of layer weights per group, so its encoder is ``bert/encoder/transformer/group_G/
inner_group_I/...`` plus ``bert/encoder/embedding_hidden_mapping_in`` (the embedding-to-hidden
projection); the names are first rewritten into transformers' module path, then the ``bert`` leaf
rules above apply (``kernel`` transposed, ``gamma``/``beta``, ``*_embeddings``):

* ``bert/encoder/transformer/group_G/inner_group_I/`` ->
  ``albert.encoder.albert_layer_groups.G.albert_layers.I.``, and within it
  ``attention_1/self/{query,key,value}/`` -> ``attention.{query,key,value}.``,
  ``attention_1/output/dense/`` -> ``attention.dense.``, ``LayerNorm/`` -> ``attention.LayerNorm.``,
  ``ffn_1/intermediate/dense/`` -> ``ffn.``, ``ffn_1/intermediate/output/dense/`` -> ``ffn_output.``,
  ``LayerNorm_1/`` -> ``full_layer_layer_norm.``;
* ``bert/`` -> ``albert.``; ``bert/pooler/dense/`` -> ``albert.pooler.``;
* ``cls/predictions/transform/{dense,LayerNorm}/`` -> ``predictions.{dense,LayerNorm}.``;
  ``cls/predictions/output_bias`` -> ``predictions.bias``;
* ``cls/seq_relationship/output_{weights,bias}`` -> ``sop_classifier.classifier.{weight,bias}``
  (sentence-order prediction); a top-level ``output_{weights,bias}`` (a fine-tuned
  classifier) -> ``classifier.{weight,bias}``;
* a leading ``module/`` (TF-Hub exports) is dropped; optimizer slots (LAMB's ``adam_m``/
  ``adam_v``) and ``global_step`` are left out as for ``bert``.

``bert-tf``: the other way, a transformers BERT state dict (``BertForPreTraining``, ``BertModel``
with ``bert.`` or without it, a fine-tuned model's ``classifier``) to google-research's TF names, the
names transformers' own ``load_tf_weights_in_bert`` reads; it undoes ``bert`` exactly, so TF -> HF
(``--preset bert``) -> TF (``--preset bert-tf``) gives back the same names and values:

* ``layer.N`` -> ``layer_N``; ``.`` -> ``/``; ``classifier`` -> ``squad``;
* a ``weight`` -> ``kernel``, **transposed**, except: under ``LayerNorm`` -> ``gamma``; of an
  ``*_embeddings`` table, dropped (``bert/embeddings/word_embeddings``); under ``seq_relationship``
  or ``classifier``, or alone -> ``output_weights`` (not transposed: already ``[out, in]``);
* a ``bias`` under ``LayerNorm`` -> ``beta``; under ``predictions``, ``seq_relationship``,
  ``classifier``, or alone -> ``output_bias``;
* transformers' tied copies (``cls.predictions.decoder.weight``/``.bias``: the word embeddings and
  ``cls.predictions.bias``) and the ``position_ids`` buffer are left out.

A name a preset does not recognise (it would leave the name as it is: HF names given to ``bert``,
TF names to ``bert-tf``) is kept as it is, and :func:`unrecognised` finds them so that ``convert``
warns with their count and a few examples.

Each preset (:class:`ModelPreset`) also names the config file google-research puts beside the
checkpoint (``bert_config.json``, ``albert_config.json``); :func:`model_config` turns it into a
transformers ``config.json`` (:func:`bert_config` for the BERT family; for ALBERT, :func:`albert_config`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Pattern, Sequence, Tuple

from ..errors import InvalidArgumentError

__all__ = ["PRESETS", "ModelPreset", "bert_name", "electra_name", "albert_name", "bert_tf_name", "unrecognised",
           "bert_config", "albert_config", "model_config"]

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


#: transformers-only entries with no google-research variable: tied copies and a buffer
_HF_ONLY = re.compile(r"(^|\.)(cls\.predictions\.decoder\.(weight|bias)|position_ids)$")
_OUTPUT_LAYERS = ("seq_relationship", "classifier")  # whose weights are already [out, in]


def bert_tf_name(name: str) -> Optional[Tuple[str, bool]]:
    """The google-research TF name of a transformers BERT tensor and whether it is transposed (None: left out).

    The inverse of :func:`bert_name` (see the module docstring).
    """
    if _HF_ONLY.search(name):
        return None
    parts = name.split(".")
    out: List[str] = []
    transpose = False
    i = 0
    while i < len(parts):
        part = parts[i]
        parent = parts[i - 1] if i else None
        last = i == len(parts) - 1
        if part == "layer" and not last and parts[i + 1].isdigit():
            out.append(f"layer_{parts[i + 1]}")
            i += 1
        elif part == "classifier":
            out.append("squad")
        elif last and part == "weight":
            if parent is None or parent in _OUTPUT_LAYERS:
                out.append("output_weights")
            elif parent == "LayerNorm":
                out.append("gamma")
            elif not parent.endswith("_embeddings"):
                out.append("kernel")
                transpose = True
        elif last and part == "bias":
            if parent is None or parent == "predictions" or parent in _OUTPUT_LAYERS:
                out.append("output_bias")
            else:
                out.append("beta" if parent == "LayerNorm" else "bias")
        else:
            out.append(part)
        i += 1
    return "/".join(out), transpose


def unrecognised(rule: Callable[[str], Optional[Tuple[str, bool]]], names: Sequence[str]) -> List[str]:
    """The ``names`` a preset's ``rule`` does not recognise: it would keep them as they are."""
    return [n for n in names if rule(n) == (n, False)]


def electra_name(name: str) -> Optional[Tuple[str, bool]]:
    """The ``ElectraForPreTraining`` (discriminator) name of an ELECTRA TF variable (None: left out)."""
    parts = name.split("/")
    if parts[0] in ("generator", "generator_predictions") or "temperature" in parts:
        return None
    return bert_name("/".join("dense_prediction" if p == "dense_1" else p for p in parts))


#: ALBERT's scopes rewritten into transformers' module path, in order, on the ``/``-joined name
#: (after ``module/`` is dropped); what is left goes through :func:`bert_name`'s leaf rules.
_ALBERT_RULES: List[Tuple[Pattern[str], str]] = [(re.compile(a), b) for a, b in [
    (r"^bert/", "albert/"),
    (r"^albert/pooler/dense/", "albert/pooler/"),
    (r"^albert/encoder/transformer/group_(\d+)/inner_group_(\d+)/",
     r"albert/encoder/albert_layer_groups/\1/albert_layers/\2/"),
    (r"(/albert_layers/\d+/)attention_1/self/", r"\1attention/"),
    (r"(/albert_layers/\d+/)attention_1/output/dense/", r"\1attention/dense/"),
    (r"(/albert_layers/\d+/)LayerNorm/", r"\1attention/LayerNorm/"),
    (r"(/albert_layers/\d+/)LayerNorm_1/", r"\1full_layer_layer_norm/"),
    (r"(/albert_layers/\d+/)ffn_1/intermediate/dense/", r"\1ffn/"),
    (r"(/albert_layers/\d+/)ffn_1/intermediate/output/dense/", r"\1ffn_output/"),
    (r"^cls/predictions/transform/", "predictions/"),
    (r"^cls/predictions/", "predictions/"),
    (r"^cls/seq_relationship/", "sop_classifier/classifier/"),
    (r"^(output_weights|output_bias)$", r"classifier/\1"),
]]


def albert_name(name: str) -> Optional[Tuple[str, bool]]:
    """The ``AlbertForPreTraining`` name of a google-research ALBERT variable and whether it is transposed."""
    if name.startswith("module/"):
        name = name[len("module/"):]
    for pattern, repl in _ALBERT_RULES:
        name = pattern.sub(repl, name)
    return bert_name(name)


def bert_config(text: str, architecture: str = "BertForPreTraining", model_type: str = "bert",
                filename: str = "bert_config.json") -> Dict[str, Any]:
    """A transformers ``config.json`` (as a dict) from the text of a google-research ``bert_config.json``."""
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise InvalidArgumentError(f"{filename} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidArgumentError(f"{filename} is not a JSON object")
    out = dict(config)
    out.setdefault("layer_norm_eps", 1e-12)
    out.setdefault("pad_token_id", 0)
    out["model_type"] = model_type
    out["architectures"] = [architecture]
    return out


def albert_config(text: str, filename: str = "albert_config.json") -> Dict[str, Any]:
    """A transformers ``config.json`` (as a dict) from a google-research ``albert_config.json``.

    google-research ALBERT's ``gelu`` is the tanh approximation, which transformers calls
    ``gelu_new`` (as the ALBERT configs on the Hugging Face Hub say); every other field is kept.
    """
    out = bert_config(text, "AlbertForPreTraining", "albert", filename)
    if out.get("hidden_act") == "gelu":
        out["hidden_act"] = "gelu_new"
    return out


@dataclass(frozen=True)
class ModelPreset:
    """One ``--preset``: the rename rule, the transformers class, and the config file beside the checkpoint."""

    rule: Callable[[str], Optional[Tuple[str, bool]]]
    architecture: str
    model_type: str
    #: the google-research config beside the checkpoint, made into ``config.json`` for ``hf`` output
    #: (None: the preset reads transformers names, and writes no ``config.json``)
    config_file: Optional[str] = "bert_config.json"
    #: ``config(text, filename)`` -> the transformers ``config.json`` as a dict.
    config: Optional[Callable[[str, str], Dict[str, Any]]] = None
    #: the preset that goes the other way (named when every name is unrecognised)
    reverse: Optional[str] = None


def model_config(preset: ModelPreset, text: str) -> Dict[str, Any]:
    """The transformers ``config.json`` (as a dict) from the text of ``preset.config_file``."""
    filename = preset.config_file or "config.json"
    if preset.config is not None:
        return preset.config(text, filename)
    return bert_config(text, preset.architecture, preset.model_type, filename)


PRESETS: Dict[str, ModelPreset] = {
    "bert": ModelPreset(bert_name, "BertForPreTraining", "bert", reverse="bert-tf"),
    "bert-tf": ModelPreset(bert_tf_name, "BertForPreTraining", "bert", None, reverse="bert"),
    "electra": ModelPreset(electra_name, "ElectraForPreTraining", "electra"),
    "albert": ModelPreset(albert_name, "AlbertForPreTraining", "albert", "albert_config.json", albert_config),
}
