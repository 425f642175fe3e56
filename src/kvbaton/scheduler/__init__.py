"""Local iteration scheduler of one worker and its waiting-queue policies (pure Python, no torch)."""
