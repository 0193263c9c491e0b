"""The two rollout engines behind the engine protocol (``rollout/protocol.py``): the transformers engine for CPU and
small models (``hf_engine``, with its token sampler ``sampling``) and the vLLM engine (``vllm_engine``) with its
environment and version gate (``vllm_env``), its in-process and launcher backends (``vllm_backend``) and the
conversion of its outputs and streams into responses (``vllm_outputs``); besides them, the stop set both engines
share (``stop_tokens``) and the engine side of a weight sync (``weight_sync``). An engine generates the responses it
is asked for and takes the weights it is sent; which prompts, when, and how batches travel to the trainer belong to
``rollout/scheduling`` and ``rollout/pipeline``, which drive the engines through the protocol. vLLM is imported only
when a ``VLLMEngine`` is built."""
