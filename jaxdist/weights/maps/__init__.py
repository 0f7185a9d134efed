"""The weight maps jaxdist ships, one YAML file each, named by ``--init-map NAME``
(and ``python -m jaxdist.export --map NAME``): ``gpt2.yaml`` maps Hugging Face's
``GPT2LMHeadModel`` to the built-in GPT. The format is in ``gpt2.yaml``'s header and in
``jaxdist.weights.weight_map``."""
