"""Checkpoints: save and resume, elastic resharding, layout-free optimizer state, conversion and export.
Role: runtime (save / resume) and tooling (conversion).

- `checkpoint.py`: atomic saves through DeepSpeed, exact resume, hook state, checks before ranks start;
- `elastic.py`: resuming at another layout (fit TP x PP to the world, reshard with optimizer state);
- `optimizer_state.py`: ZeRO optimizer state per parameter, independent of the layout;
- `convert.py`: consolidate, reshard and export (behind tools/convert_checkpoint.py);
- `hf_tokenizer.py`: the run's tokenizer as a Hugging Face tokenizer.json.
"""
