"""Pipeline folders: reading a diffusers-format folder's index, writing one, fetching one from the
Hugging Face Hub (`hub`), single weight files' layouts (`layouts`), and the embedded tiny models (the
trained default's folder, the random-weight model's configs).

The names below are imported on first use (`lazy_facade`), so that importing the package
imports none of its modules, and a JAX-free module among them loads without JAX.
"""

from lazy_facade import lazy_facade

_HOMES = (
    ("pipelines.wan.pretrained.embedded", ("TINY_DEFAULT_FOLDER", "TINY_FOLDERS", "TINY_I2V_FOLDER")),
    ("pipelines.wan.pretrained.folder", ("PipelineIndex",)),
    ("pipelines.wan.pretrained.generation_defaults", ("GenerationDefaults", "PromptWorld")),
    ("pipelines.wan.pretrained.hub", ("HubSnapshot", "download_snapshot", "hub_id")),
    ("pipelines.wan.pretrained.layouts", ("EXPECTED_FILES", "folder_layout")),
    ("pipelines.wan.pretrained.saving", ("save_pipeline",)),
    ("pipelines.wan.pretrained.sources", ("Components", "Sources", "check_no_image_branch", "read_sources",
                                          "tokenizer_of")),
    ("pipelines.wan.pretrained.tiny", ("TINY_SCHEDULER", "TINY_SEED",
                                       "TINY_TRAINED_NAMES", "TINY_TRAINED_VIDEO", "TINY_TRANSFORMER")),
)

__all__, __getattr__ = lazy_facade(__name__, _HOMES)
