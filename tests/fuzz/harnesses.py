"""The fuzz harnesses, by name: the script under ``tests/fuzz/`` and its seed corpus under ``corpus/<name>``.

Add a harness here (and its seeds in ``make_corpus.py``) and both ``tests/test_fuzz.py``
and ``scripts/fuzz.sh`` run it. The converters' readers (``safetensors``, ``npz``, the
Hugging Face folder's ``index.json``) have seeds from the converters' own writers and NumPy,
plus ``regression-*`` seeds for what fuzzing found.
"""

HARNESSES = {
    "sstable": "fuzz_sstable.py",  # the .index SSTable reader
    "bundle": "fuzz_bundle.py",  # BundleReader: whole, region and raw reads, verify, restore_tensors
    "bundle_entries": "fuzz_bundle_entries.py",  # the same reads on valid indexes with fuzzed entries
    "object_graph": "fuzz_object_graph.py",  # _CHECKPOINTABLE_OBJECT_GRAPH parsing and matching
    "state_file": "fuzz_state_file.py",  # the text-format `checkpoint` state file
    "safetensors": "fuzz_safetensors.py",  # SafetensorsSource: header checks, whole/row/into reads, convert
    "npz": "fuzz_npz.py",  # NpzSource: zip directory, .npy headers, reads, convert
    "hf_index": "fuzz_hf_index.py",  # HFSource: model.safetensors.index.json against its shard
}
