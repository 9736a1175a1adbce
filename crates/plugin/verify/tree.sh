#!/bin/sh
sh -c "ls / > /dev/null; cat /etc/hostname /nonexistent-file 2>/dev/null; echo hello-from-tree > /tmp/out.txt"
