"""compile_rng in the training loops people already use: accelerate's data loaders
(:mod:`.accelerate_rows`) and the Hugging Face ``Trainer`` (:mod:`.hf_trainer`).

The top layer: it drives :func:`compile_rng.step` and imports nothing that imports it.
"""
