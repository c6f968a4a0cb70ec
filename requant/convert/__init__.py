"""The conversion pipeline: plan from metadata, then stream tensors shard by shard.

Every conversion keeps a journal in its target directory (see io/journal.py), so a killed run
resumes where it stopped and ends byte-identical to an uninterrupted one. Each output shard is
written under a temporary name, fsynced, read back and renamed (in place: over its source
shard); config files and the index come last, and the journal goes only after them. While the
journal exists the directory has no config.json/index of either format, so nothing loads it.

The parts: pipeline.py runs a conversion (plan, journal, shards, metadata, stops), resume.py
checks that a resume is the same conversion and what is already done, abort.py ends one for good
(--abort: in place, the source back while no shard is converted), outputs.py writes (shards,
other files, metadata, free space), describe.py turns plans and results into data and lines.
"""

from requant.convert.describe import describe_plan, describe_result, format_plan, format_result
from requant.convert.outputs import (PARTIAL_SUFFIX, SourceDamaged, ancillary_files, copy_ancillary, final_metadata,
                                     finish_metadata, space_needed, write_shard)
from requant.convert.abort import abort
from requant.convert.pipeline import (AlreadyFinished, Result, Stopped, convert, plan_conversion,
                                      refuse_in_place_on_cache)
from requant.targets import Options

__all__ = ["PARTIAL_SUFFIX", "AlreadyFinished", "Options", "Result", "SourceDamaged", "Stopped", "abort",
           "ancillary_files", "convert", "copy_ancillary", "describe_plan", "describe_result", "final_metadata",
           "finish_metadata", "format_plan", "format_result", "plan_conversion", "refuse_in_place_on_cache",
           "space_needed", "write_shard"]
