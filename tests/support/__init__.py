"""What the test modules share: running the trainer and reading its output (``runs``), ERNIE-4.5-VL inputs and the
other libraries' sides (``ernie``), small models and inputs (``models``), the LoRA runs (``lora``) and the
layouts' overrides (``layouts``). The scripts here run in processes of their own."""
