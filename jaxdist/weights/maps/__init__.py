"""The weight maps jaxdist ships, one YAML file each, named by ``--init-map NAME``
(and ``python -m jaxdist.export --map NAME``): ``gpt2.yaml`` maps Hugging Face's
``GPT2LMHeadModel`` to the built-in GPT; ``llama.yaml``, ``qwen2.yaml``, ``qwen3.yaml``,
``mistral.yaml``, and the mixtures of experts ``mixtral.yaml`` and ``qwen3_moe.yaml``,
those families' ``*ForCausalLM`` to the built-in Llama, whose config.json translation
(``--model-from-config``) is ``hf_llama`` (``hf_moe`` the experts' keys; ``hf_gemma``
Gemma 2's, ``gemma2.yaml``). The format is in
``gpt2.yaml``'s header and in ``jaxdist.weights.weight_map``."""
