"""What both the builder and the runtime need of the engine's exported parts: their definitions
(``parts``: the graphs each backend compiles or exports, their weights and inputs) and the ONNX parts'
contract (``onnx_parts``: plugin nodes, dtypes, what a part mutates)."""
