"""meshpact.simulator: SimPy models built on meshpact.core.

Training with faults (:func:`simulate_training`), serving with capacity spillover
(:func:`simulate_serving`), sweeps (:func:`run_sweep`), Chrome-trace timelines
(:func:`chrome_trace`), calibration from live recordings
(:func:`calibration_from_recording`), a job on a fleet of servers replicated to an interval
(:func:`simulate_fleet`) and a live run replayed against its measurements
(:func:`replay_live`).
"""

from .calibrate import Calibration, calibration_from_recording
from .faults import Fault, fault_trace
from .fleet import (
    Estimate,
    FleetCharge,
    FleetComparison,
    FleetResult,
    FleetRun,
    fleet_charge,
    replicate,
    simulate_fleet,
)
from .replay import Replay, replay_live
from .serving import ServingParams, ServingResult, expected_tokens_per_pass, simulate_serving
from .sweep import run_sweep, save_frame
from .timeline import chrome_trace, write_chrome_trace
from .training import PolicyResult, StepFault, TimelineEvent, TrainingResult, simulate_training
from .workload import Workload, derive_workload, parameter_counts

__all__ = [
    "Calibration",
    "calibration_from_recording",
    "Fault",
    "fault_trace",
    "Estimate",
    "FleetCharge",
    "FleetComparison",
    "FleetResult",
    "FleetRun",
    "fleet_charge",
    "replicate",
    "simulate_fleet",
    "Replay",
    "replay_live",
    "ServingParams",
    "ServingResult",
    "expected_tokens_per_pass",
    "simulate_serving",
    "run_sweep",
    "save_frame",
    "chrome_trace",
    "write_chrome_trace",
    "PolicyResult",
    "StepFault",
    "TimelineEvent",
    "TrainingResult",
    "simulate_training",
    "Workload",
    "derive_workload",
    "parameter_counts",
]
