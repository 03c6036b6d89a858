"""The peers: the tools a user would pick instead of zerotrain, each training the same job as its zerotrain run
(benchmarks/common.py for bench.py's runners; the job JSON of dpo.py, grpo.py, long_context.py and lora_chat.py for
theirs). What the HF Trainer-based ones share is harness.py."""
