"""The Wan model, as components: on the ground floor `transformer`, `vae`, `encoders` and
`schedulers`, which import no other component; above them `conditioning`, `step_cache`, `lora` and
`pretrained`, which import only the ground floor (tests/test_architecture.py checks both).

Each component's `__init__` is a facade (`lazy_facade`): a `_HOMES` table of (module, names), so
that importing a component imports none of its modules. Outside `pipelines/wan/`, product code
imports a component's names from the component, never its modules.
"""
