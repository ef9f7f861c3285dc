"""Converting checkpoints between formats, streaming: ``shardckpt convert`` and ``shardckpt diff``.

Formats (see each module's docstring for what is on disk):

* ``tf``: TensorFlow tensor bundles (:mod:`.tf`) — prefix, checkpoint directory, SavedModel;
* ``safetensors``: one ``.safetensors`` file (:mod:`.safetensors`, own reader and writer);
* ``hf``: Hugging Face sharded folders (:mod:`.hf`);
* ``npz``: NumPy archives, no pickle (:mod:`.npz`);
* ``dcp``: PyTorch Distributed Checkpoint folders (:mod:`.dcp`, the ``[torch]`` extra).

Every source is read as a stream of tensors (:class:`~.model.Source`) and every
destination written from one (:class:`~.model.Sink`), one tensor in memory at a
time, committed atomically (:mod:`.atomic`). :func:`convert` applies selection and
renaming rules (:mod:`.select`, :mod:`.presets`); :func:`diff` compares two
checkpoints of any formats (:mod:`.diff`).

Example::

    from shardckpt.convert import convert, Rules
    convert("/ckpt/model.ckpt-1000", "/out/model.safetensors", rules=Rules(drop=[r"adam_[mv]$"]))
"""

from .api import ConvertResult, convert, make_sink, open_source
from .diff import DiffResult, diff
from .hf import parse_size
from .model import Sink, Source, TensorInfo
from .select import Rules

__all__ = ["convert", "open_source", "make_sink", "ConvertResult", "diff", "DiffResult", "Rules", "Source",
           "Sink", "TensorInfo", "parse_size"]
