//! sala-kernels: CubeCL kernels; under construction (the GPU issue).
