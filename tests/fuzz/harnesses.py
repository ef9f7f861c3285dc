"""The fuzz harnesses, by name: the script under ``tests/fuzz/`` and its seed corpus under ``corpus/<name>``.

Add a harness here (and its seeds in ``make_corpus.py``) and both ``tests/test_fuzz.py``
and ``scripts/fuzz.sh`` run it. Readers of other formats go here when they land:
``safetensors`` and ``npz`` (the converters), with seeds from their writers.
"""

HARNESSES = {
    "sstable": "fuzz_sstable.py",  # the .index SSTable reader
    "bundle": "fuzz_bundle.py",  # BundleReader: whole, region and raw reads, verify, restore_tensors
    "bundle_entries": "fuzz_bundle_entries.py",  # the same reads on valid indexes with fuzzed entries
    "object_graph": "fuzz_object_graph.py",  # _CHECKPOINTABLE_OBJECT_GRAPH parsing and matching
    "state_file": "fuzz_state_file.py",  # the text-format `checkpoint` state file
    # "safetensors": "fuzz_safetensors.py",  # with the converters (not yet)
    # "npz": "fuzz_npz.py",  # with the converters (not yet)
}
