"""`dsv4 fetch`: a model's files from the Hugging Face hub (or a mirror) into its cache layout,
resumable, each file checked against the hub's size and hash and the checkpoint's tensors
against the plan's. Used by the operator's download Job, by `dsv4 up` and `dsv4 serve --model
hf://...`, and by the operator to resolve a revision and read config.json. No torch."""
