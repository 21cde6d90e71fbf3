"""Engine `dsv4`: our own worker (`dsv4 serve`), reading its rank config and reporting each
rank's `/status`. Pure.
"""
