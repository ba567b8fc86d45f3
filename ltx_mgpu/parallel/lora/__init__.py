"""The LoRA tracker: the LoRAs fused into a resident transformer switched in place, the work and the clean backup
sharded over the ranks (`lora_tracker`), and what it tracks and fuses (`lora_units`)."""
