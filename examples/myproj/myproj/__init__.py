"""An example project of your own, trained by gpuflow without any change to gpuflow."""
