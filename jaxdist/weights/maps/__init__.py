"""The weight maps jaxdist ships, one YAML file each, named by ``--init-map NAME``
(and ``python -m jaxdist.export --map NAME``): ``gpt2.yaml`` maps Hugging Face's
``GPT2LMHeadModel`` to the built-in GPT; ``llama.yaml``, ``qwen2.yaml``, ``qwen3.yaml``
and ``mistral.yaml`` those families' ``*ForCausalLM`` to the built-in Llama, whose
config.json translation (``--model-from-config``) is ``hf_llama``. The format is in
``gpt2.yaml``'s header and in ``jaxdist.weights.weight_map``."""
