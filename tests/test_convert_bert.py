"""``--preset bert`` / ``electra``: google-research TF checkpoints to transformers' models.

A small BERT checkpoint in the original layout (with Adam slots and ``global_step``)
is written with shardckpt; TensorFlow reads it; it is converted to a Hugging Face
folder; then, in the TensorFlow side environment (transformers + torch + TF),
``BertForPreTraining.from_pretrained`` loads it with no missing or unexpected keys,
and every tensor equals what transformers' own ``load_tf_weights_in_bert`` makes
of the TF checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from tf_oracle.client import find_tf_python

import shardckpt
from shardckpt.convert import convert

CONFIG = {"vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
          "intermediate_size": 24, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
          "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 32, "type_vocab_size": 2,
          "initializer_range": 0.02}


def bert_variables(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    h, inter, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    shapes = {"bert/embeddings/word_embeddings": (v, h),
              "bert/embeddings/position_embeddings": (CONFIG["max_position_embeddings"], h),
              "bert/embeddings/token_type_embeddings": (CONFIG["type_vocab_size"], h),
              "bert/embeddings/LayerNorm/gamma": (h,), "bert/embeddings/LayerNorm/beta": (h,),
              "bert/pooler/dense/kernel": (h, h), "bert/pooler/dense/bias": (h,),
              "cls/predictions/transform/dense/kernel": (h, h), "cls/predictions/transform/dense/bias": (h,),
              "cls/predictions/transform/LayerNorm/gamma": (h,), "cls/predictions/transform/LayerNorm/beta": (h,),
              "cls/predictions/output_bias": (v,),
              "cls/seq_relationship/output_weights": (2, h), "cls/seq_relationship/output_bias": (2,)}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"bert/encoder/layer_{i}/"
        for name in ("query", "key", "value"):
            shapes[p + f"attention/self/{name}/kernel"] = (h, h)
            shapes[p + f"attention/self/{name}/bias"] = (h,)
        shapes[p + "attention/output/dense/kernel"] = (h, h)
        shapes[p + "attention/output/dense/bias"] = (h,)
        shapes[p + "attention/output/LayerNorm/gamma"] = (h,)
        shapes[p + "attention/output/LayerNorm/beta"] = (h,)
        shapes[p + "intermediate/dense/kernel"] = (h, inter)
        shapes[p + "intermediate/dense/bias"] = (inter,)
        shapes[p + "output/dense/kernel"] = (inter, h)
        shapes[p + "output/dense/bias"] = (h,)
        shapes[p + "output/LayerNorm/gamma"] = (h,)
        shapes[p + "output/LayerNorm/beta"] = (h,)
    values = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    for k, s in shapes.items():  # the optimizer's slots, as google-research's AdamWeightDecayOptimizer saves them
        values[k + "/adam_m"] = np.zeros(s, np.float32)
        values[k + "/adam_v"] = np.ones(s, np.float32)
    values["global_step"] = np.int64(1000)
    return values


SIDE = r"""
import json, sys
import numpy as np, torch
from transformers import BertConfig, BertForPreTraining, load_tf_weights_in_bert
hf_dir, tf_prefix, out = sys.argv[1:4]
model, info = BertForPreTraining.from_pretrained(hf_dir, output_loading_info=True)
theirs = BertForPreTraining(BertConfig.from_pretrained(hf_dir))
load_tf_weights_in_bert(theirs, theirs.config, tf_prefix)
ours_sd, theirs_sd = model.state_dict(), theirs.state_dict()
result = {"missing": info["missing_keys"], "unexpected": info["unexpected_keys"],
          "mismatched": [list(map(str, m)) for m in info["mismatched_keys"]],
          "keys_differ": sorted(set(ours_sd) ^ set(theirs_sd)),
          "unequal": [k for k in ours_sd if not torch.equal(ours_sd[k], theirs_sd[k])],
          "compared": len(ours_sd), "architectures": model.config.architectures}
json.dump(result, open(out, "w"))
"""


def test_bert_preset_matches_transformers(tmp_path: Path, tf_oracle) -> None:  # type: ignore[no-untyped-def]
    values = bert_variables()
    ckpt_dir = tmp_path / "uncased_L-2_H-16"
    prefix = str(ckpt_dir / "bert_model.ckpt")
    shardckpt.save_tensors(prefix, values)
    (ckpt_dir / "bert_config.json").write_text(json.dumps(CONFIG))
    got, errors, _ = tf_oracle.load_checkpoint(prefix)  # TensorFlow reads the google-research layout
    assert errors == {} and sorted(got) == sorted(values)

    hf = tmp_path / "hf"
    result = convert(prefix, str(hf), dst_format="hf", preset="bert")
    assert "global_step" in result.left_out and all(k.endswith(("adam_m", "adam_v")) or k == "global_step"
                                                    for k in result.left_out)
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "bert" and config["hidden_size"] == 16
    report = tmp_path / "report.json"
    side = subprocess.run([find_tf_python(), "-c", SIDE, str(hf), prefix, str(report)], capture_output=True,
                          text=True, timeout=300)
    assert side.returncode == 0, side.stderr[-4000:]
    outcome = json.loads(report.read_text())
    assert outcome["missing"] == [] and outcome["unexpected"] == [] and outcome["mismatched"] == []
    assert outcome["keys_differ"] == [] and outcome["unequal"] == []
    assert outcome["compared"] > 30 and outcome["architectures"] == ["BertForPreTraining"]


ELECTRA_SIDE = r"""
import json, sys
import torch
from transformers import ElectraConfig, ElectraForPreTraining, load_tf_weights_in_electra
hf_dir, tf_prefix, out = sys.argv[1:4]
model, info = ElectraForPreTraining.from_pretrained(hf_dir, output_loading_info=True)
theirs = ElectraForPreTraining(ElectraConfig.from_pretrained(hf_dir))
load_tf_weights_in_electra(theirs, theirs.config, tf_prefix)
ours_sd, theirs_sd = model.state_dict(), theirs.state_dict()
json.dump({"missing": info["missing_keys"], "unexpected": info["unexpected_keys"],
           "unequal": [k for k in ours_sd if not torch.equal(ours_sd[k], theirs_sd[k])],
           "compared": len(ours_sd)}, open(out, "w"))
"""


def test_electra_preset_matches_transformers(tmp_path: Path) -> None:
    """ELECTRA's discriminator: ``dense_1`` -> ``dense_prediction``, generator variables left out."""
    bert = bert_variables(1)
    values = {}
    for k, v in bert.items():
        if k.startswith("bert/") and "pooler" not in k:
            values["electra/" + k[len("bert/"):]] = v
    h = CONFIG["hidden_size"]
    rng = np.random.default_rng(2)
    values["discriminator_predictions/dense/kernel"] = rng.standard_normal((h, h)).astype(np.float32)
    values["discriminator_predictions/dense/bias"] = rng.standard_normal(h).astype(np.float32)
    values["discriminator_predictions/dense_1/kernel"] = rng.standard_normal((h, 1)).astype(np.float32)
    values["discriminator_predictions/dense_1/bias"] = rng.standard_normal(1).astype(np.float32)
    values["generator_predictions/output_bias"] = np.zeros(CONFIG["vocab_size"], np.float32)
    values["global_step"] = np.int64(3)
    prefix = str(tmp_path / "electra" / "model.ckpt")
    shardckpt.save_tensors(prefix, values)
    (tmp_path / "electra" / "bert_config.json").write_text(json.dumps(dict(CONFIG, embedding_size=h)))
    hf = tmp_path / "hf"
    # transformers' loader skips nothing but global_step/temperature: give it only the discriminator
    disc = str(tmp_path / "disc" / "model.ckpt")
    shardckpt.save_tensors(disc, {k: v for k, v in values.items() if not k.startswith("generator")})
    convert(prefix, str(hf), dst_format="hf", preset="electra")
    report = tmp_path / "report.json"
    side = subprocess.run([find_tf_python(), "-c", ELECTRA_SIDE, str(hf), disc, str(report)], capture_output=True,
                          text=True, timeout=300)
    assert side.returncode == 0, side.stderr[-4000:]
    outcome = json.loads(report.read_text())
    assert outcome["missing"] == [] and outcome["unexpected"] == [] and outcome["unequal"] == []
    assert outcome["compared"] > 30


# -- issue 29: back to google-research's names (--preset bert-tf), and the round trip ----------------------------------

def released(values: dict) -> dict:
    """``values`` without the optimizer's slots and ``global_step`` (what ``--preset bert`` keeps)."""
    return {k: v for k, v in values.items() if not k.endswith(("/adam_m", "/adam_v")) and k != "global_step"}


def test_bert_tf_preset_undoes_bert_name_by_name() -> None:
    """Every name ``bert`` makes (with a fine-tuned SQuAD head and a top-level classifier) comes back as it was,
    transposed exactly where ``bert`` transposed; transformers' tied copies and buffers are left out."""
    from shardckpt.convert.presets import bert_name, bert_tf_name

    names = list(released(bert_variables())) + ["cls/squad/output_weights", "cls/squad/output_bias",
                                                 "output_weights", "output_bias"]
    for name in names:
        hf = bert_name(name)
        assert hf is not None and hf[0] != name
        assert bert_tf_name(hf[0]) == (name, hf[1]), name
    for tied in ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "bert.embeddings.position_ids"):
        assert bert_tf_name(tied) is None


def test_bert_round_trip_tf_hf_tf_is_bit_exact(tmp_path: Path, tf_oracle) -> None:  # type: ignore[no-untyped-def]
    """google-research TF -> HF (``--preset bert``) -> TF (``--preset bert-tf``), with no ``--map``: the same names
    and bytes as the original (``shardckpt diff`` exits 0), TensorFlow reads it, and transformers' own
    ``load_tf_weights_in_bert`` makes of it the model ``from_pretrained`` makes of the HF folder."""
    values = bert_variables(3)
    google = str(tmp_path / "google" / "bert_model.ckpt")
    shardckpt.save_tensors(google, values)
    (tmp_path / "google" / "bert_config.json").write_text(json.dumps(CONFIG))
    hf = tmp_path / "hf"
    convert(google, str(hf), dst_format="hf", preset="bert")
    back = str(tmp_path / "back" / "bert_model.ckpt")
    result = convert(str(hf), back, dst_format="tf", preset="bert-tf")
    assert result.warnings == [] and result.left_out == []

    want = released(values)
    original = str(tmp_path / "released" / "bert_model.ckpt")  # the original, less what bert leaves out
    shardckpt.save_tensors(original, want)
    diff = subprocess.run([sys.executable, "-m", "shardckpt.cli.main", "diff", original, back],
                          capture_output=True, text=True, timeout=120)
    assert diff.returncode == 0, diff.stdout + diff.stderr
    got, errors, _ = tf_oracle.load_checkpoint(back)
    assert errors == {} and sorted(got) == sorted(want)
    for k, v in want.items():
        assert np.asarray(got[k]).tobytes() == v.tobytes(), k

    report = tmp_path / "report.json"
    side = subprocess.run([find_tf_python(), "-c", SIDE, str(hf), back, str(report)], capture_output=True,
                          text=True, timeout=300)
    assert side.returncode == 0, side.stderr[-4000:]
    outcome = json.loads(report.read_text())
    assert outcome["keys_differ"] == [] and outcome["unequal"] == [] and outcome["compared"] > 30
