//! One golden case directory: load, run through our executor or OpenVINO, compare.
