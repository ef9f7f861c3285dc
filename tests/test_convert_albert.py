"""``--preset albert``: google-research ALBERT checkpoints to ``transformers.AlbertForPreTraining``.

A small ALBERT checkpoint in the original layout (two groups of two shared layers, a
factorized embedding, LAMB's ``adam_m``/``adam_v`` slots and ``global_step``) is written
with shardckpt; ``shardckpt convert --preset albert`` (the command
line) turns it into a Hugging Face folder with a ``config.json`` from the
``albert_config.json`` beside it; then, in the TensorFlow side environment
(transformers 4.57.6 + torch + TF, pinned by ``scripts/test.sh``) TensorFlow reads
the original checkpoint, ``AlbertForPreTraining.from_pretrained`` loads it with no missing, unexpected or
mismatched keys, and every tensor equals what transformers' own
``load_tf_weights_in_albert`` makes of the TF checkpoint.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
from tf_oracle.client import find_tf_python

import shardckpt
from shardckpt.cli.main import main
from shardckpt.convert.presets import PRESETS, albert_name, model_config

CONFIG = {"vocab_size": 50, "embedding_size": 8, "hidden_size": 16, "num_hidden_layers": 4,
          "num_hidden_groups": 2, "inner_group_num": 2, "num_attention_heads": 2, "intermediate_size": 24,
          "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
          "max_position_embeddings": 32, "type_vocab_size": 2, "initializer_range": 0.02,
          "net_structure_type": 0, "layers_to_keep": [], "gap_size": 0, "num_memory_blocks": 0,
          "down_scale_factor": 1}


def albert_variables(seed: int = 0) -> dict:
    """Every variable of google-research ALBERT's pre-training graph for :data:`CONFIG`, with LAMB slots."""
    rng = np.random.default_rng(seed)
    e, h, inter, v = CONFIG["embedding_size"], CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    shapes = {"bert/embeddings/word_embeddings": (v, e),
              "bert/embeddings/position_embeddings": (CONFIG["max_position_embeddings"], e),
              "bert/embeddings/token_type_embeddings": (CONFIG["type_vocab_size"], e),
              "bert/embeddings/LayerNorm/gamma": (e,), "bert/embeddings/LayerNorm/beta": (e,),
              "bert/encoder/embedding_hidden_mapping_in/kernel": (e, h),
              "bert/encoder/embedding_hidden_mapping_in/bias": (h,),
              "bert/pooler/dense/kernel": (h, h), "bert/pooler/dense/bias": (h,),
              "cls/predictions/transform/dense/kernel": (h, e), "cls/predictions/transform/dense/bias": (e,),
              "cls/predictions/transform/LayerNorm/gamma": (e,), "cls/predictions/transform/LayerNorm/beta": (e,),
              "cls/predictions/output_bias": (v,),
              "cls/seq_relationship/output_weights": (2, h), "cls/seq_relationship/output_bias": (2,)}
    for g in range(CONFIG["num_hidden_groups"]):
        for i in range(CONFIG["inner_group_num"]):
            p = f"bert/encoder/transformer/group_{g}/inner_group_{i}/"
            for name in ("query", "key", "value"):
                shapes[p + f"attention_1/self/{name}/kernel"] = (h, h)
                shapes[p + f"attention_1/self/{name}/bias"] = (h,)
            shapes[p + "attention_1/output/dense/kernel"] = (h, h)
            shapes[p + "attention_1/output/dense/bias"] = (h,)
            shapes[p + "LayerNorm/gamma"] = (h,)
            shapes[p + "LayerNorm/beta"] = (h,)
            shapes[p + "ffn_1/intermediate/dense/kernel"] = (h, inter)
            shapes[p + "ffn_1/intermediate/dense/bias"] = (inter,)
            shapes[p + "ffn_1/intermediate/output/dense/kernel"] = (inter, h)
            shapes[p + "ffn_1/intermediate/output/dense/bias"] = (h,)
            shapes[p + "LayerNorm_1/gamma"] = (h,)
            shapes[p + "LayerNorm_1/beta"] = (h,)
    values = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    for k, s in shapes.items():  # the LAMB optimizer's slots, named as google-research ALBERT saves them
        values[k + "/adam_m"] = np.zeros(s, np.float32)
        values[k + "/adam_v"] = np.ones(s, np.float32)
    values["global_step"] = np.int64(125000)
    return values


SIDE = r"""
import json, sys
import numpy as np, tensorflow as tf, torch
from transformers import AlbertConfig, AlbertForPreTraining, load_tf_weights_in_albert
hf_dir, tf_prefix, expected_npz, out = sys.argv[1:5]
expected = dict(np.load(expected_npz))
names = [name for name, _ in tf.train.list_variables(tf_prefix)]
tf_wrong = [n for n in names if not np.array_equal(tf.train.load_variable(tf_prefix, n), expected[n])]
model, info = AlbertForPreTraining.from_pretrained(hf_dir, output_loading_info=True)
theirs = AlbertForPreTraining(AlbertConfig.from_pretrained(hf_dir))
before = {k: v.clone() for k, v in theirs.state_dict().items()}
load_tf_weights_in_albert(theirs, theirs.config, tf_prefix)
ours_sd, theirs_sd = model.state_dict(), theirs.state_dict()
json.dump({"tf_names": sorted(names), "tf_wrong": tf_wrong,
           "missing": info["missing_keys"], "unexpected": info["unexpected_keys"],
           "mismatched": [list(map(str, m)) for m in info["mismatched_keys"]],
           "keys_differ": sorted(set(ours_sd) ^ set(theirs_sd)),
           "unequal": [k for k in ours_sd if not torch.equal(ours_sd[k], theirs_sd[k])],
           "untouched_by_theirs": [k for k in theirs_sd if torch.equal(before[k], theirs_sd[k])],
           "compared": len(ours_sd), "architectures": model.config.architectures,
           "hidden_act": model.config.hidden_act, "groups": model.config.num_hidden_groups,
           "inner": model.config.inner_group_num}, open(out, "w"))
"""


def test_albert_preset_matches_transformers(tmp_path: Path) -> None:
    values = albert_variables()
    ckpt_dir = tmp_path / "albert_base"
    prefix = str(ckpt_dir / "model.ckpt-best")
    shardckpt.save_tensors(prefix, values)
    (ckpt_dir / "albert_config.json").write_text(json.dumps(CONFIG))
    expected = tmp_path / "expected.npz"
    np.savez(expected, **values)

    hf = tmp_path / "hf"
    assert main(["convert", prefix, str(hf), "--to", "hf", "--preset", "albert", "--json"]) == 0
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == sum(not k.endswith(("adam_m", "adam_v")) for k in values) - 1
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "albert" and config["architectures"] == ["AlbertForPreTraining"]
    assert config["embedding_size"] == 8 and config["hidden_act"] == "gelu_new"

    report = tmp_path / "report.json"
    side = subprocess.run([find_tf_python(), "-c", SIDE, str(hf), prefix, str(expected), str(report)],
                          capture_output=True, text=True, timeout=300)
    assert side.returncode == 0, side.stderr[-4000:]
    outcome = json.loads(report.read_text())
    # TensorFlow reads the google-research layout shardckpt wrote, every value exact
    assert outcome["tf_names"] == sorted(values) and outcome["tf_wrong"] == []
    assert outcome["missing"] == [] and outcome["unexpected"] == [] and outcome["mismatched"] == []
    assert outcome["keys_differ"] == [] and outcome["unequal"] == []
    # transformers' loader set every weight (the tied decoder follows the embeddings and output bias)
    assert outcome["untouched_by_theirs"] == []
    assert outcome["compared"] == 82 and outcome["architectures"] == ["AlbertForPreTraining"]
    assert (outcome["hidden_act"], outcome["groups"], outcome["inner"]) == ("gelu_new", 2, 2)


def test_albert_names_outside_the_pretraining_graph() -> None:
    """TF-Hub's ``module/`` prefix, a fine-tuned classifier, and what is left out."""
    assert albert_name("module/bert/encoder/transformer/group_0/inner_group_0/LayerNorm_1/gamma") == (
        "albert.encoder.albert_layer_groups.0.albert_layers.0.full_layer_layer_norm.weight", False)
    assert albert_name("output_weights") == ("classifier.weight", False)
    assert albert_name("output_bias") == ("classifier.bias", False)
    assert albert_name("bert/pooler/dense/kernel") == ("albert.pooler.weight", True)
    for skipped in ("global_step", "bert/pooler/dense/kernel/adam_v", "cls/predictions/output_bias/adam_m"):
        assert albert_name(skipped) is None
    # the preset's config: model_type albert; fields transformers does not know are kept, gelu is tanh gelu
    config = model_config(PRESETS["albert"], json.dumps(dict(CONFIG, hidden_act="relu")))
    assert config["model_type"] == "albert" and config["hidden_act"] == "relu" and config["gap_size"] == 0
