"""Media and weights I/O: checkpoint folders (weights.py), first-frame images (images.py), H.264 MP4 and
fragmented MP4 (video.py)."""
