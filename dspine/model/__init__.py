"""The drafter: its config, layers, transfer space and injection, transition scorer and
selection, the drafter module itself and its checkpoint format. No engine, no SGLang."""
