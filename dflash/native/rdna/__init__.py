"""An instruction-level interpreter of AMD RDNA3.5 (gfx1151) and RDNA4 (gfx1201) code objects, so the
narrow-MMVQ kernels the project ships execute here without an AMD GPU: `codeobj` reads a code
object (kernels, descriptors, argument metadata), `decode` turns its text into prepared instructions
(the encodings and operand tables come from tinygrad's wheel), `semantics` gives each instruction
the behaviour AMD's ISA documents give it, and `machine` runs a launch grid of wave32 workgroups
against host buffers. What it proves is stated in hip_kernels/README.md: the shipped instruction
streams under the documents' semantics, not silicon, not ROCm's compiler, not the runtime."""
