"""ovdflash export stage: target and DFlash drafter to OpenVINO IR (needs torch)."""
