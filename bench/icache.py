#!/usr/bin/env python3
"""iCache benchmarks (issue 4, Sky §7 and §9): priority vs LRU cache, same size, same disk model.

Workloads (each in a fresh guest per configuration, timed inside the guest):
  find     unpack a source-like tree (FILES files, from a tar on a read-only extra disk) into a
           fresh ext4 (made on the host, so the classifier knows the journal), sync, drop the
           guest's caches, then `find` for a name that does not exist (Sky §7.2.1)
  sqlite   the SQLite stand-in of the DB row: load two base tables (writes hinted class 4 by the
           LD_PRELOAD shim), build large secondary indexes (hinted class 0, lowest), drop caches,
           then run a Q16-shaped join over the base tables that uses no secondary index
           (Sky §7.2.2): a scan of partsupp (stored in random part order) with a primary-key
           lookup of part per row
  mariadb  Sky §7.2.2 on a real database server: MariaDB 10.11 (Debian bookworm's mariadbd,
           unmodified, started by hand with its datadir on the extra disk), TPC-H's part,
           supplier and partsupp at scale factor SF (a dbgen-like generator run in the guest),
           secondary indexes built after the load, then TPC-H query 16 itself (its SQL text,
           validation parameters) after a server restart and `drop_caches`.
Configurations per disk model (hdd, ssd; the model applies to every extra disk):
  nocache       no cache, no interception
  lru           LRU cache, no interception (the bcache baseline of Sky)
  lru+insights  LRU cache with --insights (interception overhead, same policy)
  priority      priority cache with --insights (Sky's iCache)
Prints a Markdown table: phase times, the speedup of priority over lru, hit rates by class.

The mariadb workload and its hints. Sky changed MySQL to tag I/O to the clustered index (which
holds the table data) high and I/O to secondary indexes low. MariaDB is not modified here, so
the hint must come from what the LD_PRELOAD shim can see: the file a read or write is on.
InnoDB cannot be split that way: a table's secondary indexes live in the same tablespace file
as its clustered index (the .ibd with innodb_file_per_table, else ibdata1), MariaDB has no
general tablespaces (CREATE TABLESPACE is not supported, MDEV-19294) and no per-index file
placement; which index a page belongs to is known only inside InnoDB. (InnoDB's own I/O would
escape the shim too: O_DIRECT from the buffer pool through io_uring/libaio, so vmsight sees
anonymous pages, class "unknown".) MyISAM keeps a table's rows in <table>.MYD and all its
indexes in <table>.MYI, read and written with read/pread/write/pwrite through the page cache,
so the shim tells them apart: mariadbd runs with
VMSIGHT_HINTS='/mnt/db/tpch/*.MYD=4;/mnt/db/tpch/*.MYI=0' for its whole life (one setting, no
switching per phase). The tables are created as TPC-H's own DDL (dss.ddl) has them, without
primary keys (a MyISAM primary key would sit in the .MYI with the secondary indexes): the .MYD
then holds what InnoDB's clustered index would, the rows, and the .MYI only the secondary
indexes (ps_suppkey, ps_comment, (ps_supplycost, ps_comment), p_name, (p_container,
p_retailprice), s_nationkey: none usable by Q16). They are declared at CREATE TABLE, disabled
(ALTER TABLE ... DISABLE KEYS) before LOAD DATA and built after it by ALTER TABLE ... ENABLE
KEYS, MyISAM's sort-based bulk build, which writes the .MYI only. Q16 joins part and partsupp
by a hash join over full scans of their .MYD files (join_cache_level=4: "hash_ALL ... BNLH
join" in the EXPLAIN the script prints), using no index at all. The cache sees the hints as
the class of the blocks written: .MYD blocks enter at class 4, .MYI blocks at class 0, where
under priority they only displace each other and data of unknown size. A read's class comes
from its page's owner before the read goes down, the file's size class (Sky Table 6; at the
default sf partsupp.MYD is class 0, part.MYD class 1), so query hits are counted there.
A prep guest, once per invocation, runs mariadb-install-db on a template disk and the
generator onto a second disk; every run starts from a sparse copy of the template, copies the
.tbl files into its tmpfs (untimed) and loads them from there.

  bench/icache.py [--files N] [--cache-mib M] [--rows R] [--sf SF] [--only find,sqlite,mariadb]
                  [--models hdd,ssd] [--configs nocache,lru,lru+insights,priority] [--reps N]
                  [--verbose] [--out PATH]

Every run (phase times in the guest, host wall time, the cache's counters; for mariadb the
database's file sizes, Q16's row count and checksum, and the insight log's bytes per file kind
and class) goes to bench/results/icache.json (--out).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from trees import ext4, make_tree_tar  # noqa: E402
import results as bench_results  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
VMSIGHT = os.environ.get("VMSIGHT", os.path.join(REPO, "target", "release", "vmsight"))
PRELOAD = "LD_PRELOAD=/usr/local/lib/libvmsight-preload.so"


FIND_SCRIPT = """set -e
mount /dev/vdb /mnt
t0=$(date +%s.%N); tar xf /dev/vdc -C /mnt; sync; t1=$(date +%s.%N)
# Checkpoint the journal (freeze/thaw), so every metadata block is at its home location
# before find, whatever the timing of jbd2's own checkpoints: the same state in every run.
fsfreeze -f /mnt; fsfreeze -u /mnt
echo 3 > /proc/sys/vm/drop_caches
t2=$(date +%s.%N); find /mnt -name no-such-file-anywhere; t3=$(date +%s.%N)
echo "files $(find /mnt -type f | wc -l)"
umount /mnt
echo "T unpack $t0 $t1"; echo "T find $t2 $t3"
"""


def sqlite_script(rows):
    load = f"""PRAGMA page_size=4096;
CREATE TABLE part(p_partkey INTEGER PRIMARY KEY, p_brand TEXT, p_type TEXT, p_size INT, p_pad TEXT);
CREATE TABLE partsupp(ps_partkey INT, ps_suppkey INT, ps_cost REAL, ps_pad TEXT);
BEGIN;
WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x < {rows})
INSERT INTO part SELECT x, 'Brand#'||(x%50), 'TYPE'||(x%150), x%50, hex(randomblob(40)) FROM c;
WITH RECURSIVE c(x) AS (SELECT 0 UNION ALL SELECT x+1 FROM c WHERE x < {4 * rows - 1})
INSERT INTO partsupp SELECT (x*7919)%{rows}+1, (x*31)%1000, (x%977)*1.5, hex(randomblob(24)) FROM c;
COMMIT;"""
    index = """CREATE INDEX i1 ON partsupp(ps_pad, ps_cost);
CREATE INDEX i2 ON part(p_pad, p_type);
CREATE INDEX i3 ON partsupp(ps_cost, ps_pad);
CREATE INDEX i4 ON part(p_type, p_pad);"""
    query = """SELECT p_brand, p_type, p_size, count(DISTINCT ps_suppkey) AS n
FROM partsupp NOT INDEXED JOIN part ON p_partkey = ps_partkey
WHERE p_brand <> 'Brand#45' AND p_size IN (49, 14, 23, 45, 19, 3, 36, 9)
GROUP BY p_brand, p_type, p_size ORDER BY n DESC LIMIT 3;"""
    return f"""set -e
mount /dev/vdb /mnt; mkdir /mnt/db
cat > /tmp/load.sql <<'EOF'
{load}
EOF
cat > /tmp/index.sql <<'EOF'
{index}
EOF
cat > /tmp/query.sql <<'EOF'
{query}
EOF
t0=$(date +%s.%N)
VMSIGHT_HINTS='/mnt/db/*=4' {PRELOAD} sqlite3 /mnt/db/t.db < /tmp/load.sql; sync
t1=$(date +%s.%N)
VMSIGHT_HINTS='/mnt/db/*=0' {PRELOAD} sqlite3 /mnt/db/t.db < /tmp/index.sql; sync
t2=$(date +%s.%N)
echo 3 > /proc/sys/vm/drop_caches
t3=$(date +%s.%N)
{PRELOAD} sqlite3 /mnt/db/t.db < /tmp/query.sql
t4=$(date +%s.%N)
echo "dbsize $(stat -c %s /mnt/db/t.db)"
umount /mnt
echo "T load $t0 $t1"; echo "T index $t1 $t2"; echo "T query $t3 $t4"
"""


# --- mariadb: TPC-H Q16 on MariaDB 10.11 (Sky §7.2.2) ---------------------------------------

# dbgen-like generator of TPC-H's part, supplier and partsupp, run in the guest (python3-minimal).
TPCH_DBGEN = r'''"""TPC-H part, supplier and partsupp as dbgen's .tbl files ('|'-separated, one row a line),
deterministic (seed 1): column types and value rules of TPC-H 3.0 clause 4.2.3; comments are
slices of a pseudo-text pool made from TPC-H's word lists, as dbgen does.
  python3 dbgen.py SF OUTDIR"""
import os
import random
import sys

sf = float(sys.argv[1])
out = sys.argv[2]
r = random.Random(1)
rnd = r.random
COLORS = ("almond antique aquamarine azure beige bisque black blanched blue blush brown burlywood "
          "burnished chartreuse chiffon chocolate coral cornflower cornsilk cream cyan dark deep dim "
          "dodger drab firebrick floral forest frosted gainsboro ghost goldenrod green grey honeydew "
          "hot indian ivory khaki lace lavender lawn lemon light lime linen magenta maroon medium "
          "metallic midnight mint misty moccasin navajo navy olive orange orchid pale papaya peach "
          "peru pink plum powder puff purple red rose rosy royal saddle salmon sandy seashell sienna "
          "sky slate smoke snow spring steel tan thistle tomato turquoise violet wheat white "
          "yellow").split()
TYPES = [f"{a} {b} {c}" for a in "STANDARD SMALL MEDIUM LARGE ECONOMY PROMO".split()
         for b in "ANODIZED BURNISHED PLATED POLISHED BRUSHED".split()
         for c in "TIN NICKEL BRASS STEEL COPPER".split()]
CONTAINERS = [f"{a} {b}" for a in "SM LG MED JUMBO WRAP".split()
              for b in "CASE BOX BAG JAR PKG PACK CAN DRUM".split()]
NOUNS = ("foxes,ideas,theodolites,pinto beans,instructions,dependencies,excuses,platelets,"
         "asymptotes,courts,dolphins,multipliers,sauternes,warthogs,frets,dinos,attainments,somas,"
         "Tiresias',patterns,forges,braids,hockey players,frays,warhorses,dugouts,notornis,"
         "epitaphs,pearls,tithes,waters,orbits,gifts,sheaves,depths,sentiments,decoys,realms,pains,"
         "grouches,escapades").split(",")
VERBS = ("sleep wake are cajole haggle nag use boost affix detect integrate maintain nod was lose "
         "sublate solve thrash promise engage hinder print x-ray breach eat grow impress mold poach "
         "serve run dazzle snooze doze unwind kindle play hang believe doubt").split()
ADJS = ("furious sly careful blithe quick fluffy slow quiet ruthless thin close dogged daring brave "
        "stealthy permanent enticing idle busy regular final ironic even bold silent").split()
ADVS = ("sometimes always never furiously slyly carefully blithely quickly fluffily slowly quietly "
        "ruthlessly thinly closely doggedly daringly bravely stealthily permanently enticingly "
        "idly busily regularly finally ironically evenly boldly silently").split()
PREPS = ("about,above,according to,across,after,against,along,alongside of,among,around,at,atop,"
         "before,behind,beneath,beside,besides,between,beyond,by,despite,during,except,for,from,"
         "in place of,inside,instead of,into,near,of,on,outside,over,past,since,through,"
         "throughout,to,toward,under,until,up,upon,without,with,within").split(",")
TERMS = [".", ";", ":", "?", "!", "--"]


def pick(seq):
    return seq[int(rnd() * len(seq))]


def sentence():
    w = [pick(ADJS), pick(NOUNS), pick(VERBS), pick(ADVS)]
    if rnd() < 0.5:
        w += [pick(PREPS), "the", pick(ADJS), pick(NOUNS)]
    return " ".join(w) + pick(TERMS)


# dbgen draws every comment from one pre-generated text pool (300 MB there, 4 MiB here).
POOL = " ".join(sentence() for _ in range(90000))[: 4 << 20]
PLEN = len(POOL) - 256


def text(lo, hi):
    n = lo + int(rnd() * (hi - lo + 1))
    o = int(rnd() * PLEN)
    return POOL[o:o + n].strip().replace("|", " ")


P = max(1, int(sf * 200000))
S = max(4, int(sf * 10000))
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "supplier.tbl"), "w") as f:
    lines = []
    complaints = set(r.sample(range(1, S + 1), max(1, int(sf * 5))))
    recommends = set(r.sample(sorted(set(range(1, S + 1)) - complaints), max(1, int(sf * 5))))
    for k in range(1, S + 1):
        nation = int(rnd() * 25)
        c = text(25, 100)
        if k in complaints or k in recommends:
            tail = "Complaints" if k in complaints else "Recommends"
            i = int(rnd() * max(1, len(c) - 30))
            c = (c[:i] + "Customer " + c[i:i + 10] + tail + c[i + 10:])[:100]
        lines.append(f"{k}|Supplier#{k:09d}|{text(10, 40)}|{nation}|{nation + 10}-"
                     f"{100 + int(rnd() * 900)}-{100 + int(rnd() * 900)}-{1000 + int(rnd() * 9000)}|"
                     f"{(int(rnd() * 1099999) - 99999) / 100:.2f}|{c}\n")
    f.writelines(lines)
with open(os.path.join(out, "part.tbl"), "w") as pf, open(os.path.join(out, "partsupp.tbl"), "w") as sf_:
    for k0 in range(1, P + 1, 10000):
        parts, supps = [], []
        for k in range(k0, min(P, k0 + 9999) + 1):
            m = 1 + int(rnd() * 5)
            name = " ".join(r.sample(COLORS, 5))
            price = (90000 + ((k // 10) % 20001) + 100 * (k % 1000)) / 100
            parts.append(f"{k}|{name}|Manufacturer#{m}|Brand#{m}{1 + int(rnd() * 5)}|{pick(TYPES)}|"
                         f"{1 + int(rnd() * 50)}|{pick(CONTAINERS)}|{price:.2f}|{text(5, 22)}\n")
            for i in range(4):
                s = (k + i * (S // 4 + (k - 1) // S)) % S + 1
                supps.append(f"{k}|{s}|{1 + int(rnd() * 9999)}|{(100 + int(rnd() * 99901)) / 100:.2f}|"
                             f"{text(49, 198)}\n")
        pf.writelines(parts)
        sf_.writelines(supps)
print(f"dbgen sf {sf}: part {P}, partsupp {4 * P}, supplier {S} rows")
'''

# The server's whole configuration (no Debian config files are read: --defaults-file).
MARIADB_CNF = """[mysqld]
user=root
datadir=/mnt/db
socket=/tmp/mysqld.sock
pid-file=/tmp/mysqld.pid
log-error=/tmp/mysqld.err
tmpdir=/tmp
skip-networking
character-set-server=latin1
default-storage-engine=MyISAM
# MyISAM holds the TPC-H tables (the hint design, top of bench/icache.py). Index pages of one
# disk block (default 1 KiB): every key-page write is a whole 4 KiB block, which the
# classifier ties to its pwrite (and hint) by checksum instead of completing a partial block.
myisam_block_size=4096
# The key cache holds .MYI blocks only; the query uses no index. Rows go through the guest's
# page cache (dropped before the query). Default sort buffer (128 MiB): ENABLE KEYS sorts in
# memory up to SF ~1, no temporary files.
key_buffer_size=8M
# Hash join (BNLH) for the index-less equi-join of Q16; the default (2) allows only the block
# nested loop, which compares every partsupp row with every buffered part row.
join_cache_level=4
join_buffer_size=32M
# InnoDB cannot be turned off in 10.11; it holds only its own files here (system tablespace,
# redo log: no TPC-H data), so they are kept small. Its O_DIRECT + io_uring I/O would be
# "unknown" to vmsight (anonymous buffers, no syscall buffer for the shim to tag); with no
# table in it that is a few MiB at server start and stop, so it is left at the defaults.
innodb_buffer_pool_size=16M
innodb_log_file_size=8M
# No buffer pool dump at shutdown and reload at start: that reload re-read ~5 MiB of ibdata1
# at every server start, just before the query, for pages no query here needs.
innodb_buffer_pool_dump_at_shutdown=OFF
innodb_buffer_pool_load_at_startup=OFF
# Aria holds the system tables (mysql.*).
aria_pagecache_buffer_size=8M
[client]
socket=/tmp/mysqld.sock
user=root
"""

# TPC-H's DDL (dss.ddl: no keys) as MyISAM tables, with secondary indexes that Q16 cannot use,
# disabled until the index phase.
TPCH_SCHEMA = """CREATE DATABASE tpch;
USE tpch;
CREATE TABLE part (
  p_partkey INT NOT NULL, p_name VARCHAR(55) NOT NULL, p_mfgr CHAR(25) NOT NULL,
  p_brand CHAR(10) NOT NULL, p_type VARCHAR(25) NOT NULL, p_size INT NOT NULL,
  p_container CHAR(10) NOT NULL, p_retailprice DECIMAL(15,2) NOT NULL,
  p_comment VARCHAR(23) NOT NULL,
  KEY i_p_name (p_name), KEY i_p_container (p_container, p_retailprice)
) ENGINE=MyISAM;
CREATE TABLE supplier (
  s_suppkey INT NOT NULL, s_name CHAR(25) NOT NULL, s_address VARCHAR(40) NOT NULL,
  s_nationkey INT NOT NULL, s_phone CHAR(15) NOT NULL, s_acctbal DECIMAL(15,2) NOT NULL,
  s_comment VARCHAR(101) NOT NULL,
  KEY i_s_nationkey (s_nationkey)
) ENGINE=MyISAM;
CREATE TABLE partsupp (
  ps_partkey INT NOT NULL, ps_suppkey INT NOT NULL, ps_availqty INT NOT NULL,
  ps_supplycost DECIMAL(15,2) NOT NULL, ps_comment VARCHAR(199) NOT NULL,
  KEY i_ps_suppkey (ps_suppkey), KEY i_ps_comment (ps_comment),
  KEY i_ps_supplycost (ps_supplycost, ps_comment)
) ENGINE=MyISAM;
ALTER TABLE part DISABLE KEYS;
ALTER TABLE supplier DISABLE KEYS;
ALTER TABLE partsupp DISABLE KEYS;"""

TPCH_LOAD = """LOAD DATA INFILE '/tmp/tbl/part.tbl' INTO TABLE part FIELDS TERMINATED BY '|';
LOAD DATA INFILE '/tmp/tbl/supplier.tbl' INTO TABLE supplier FIELDS TERMINATED BY '|';
LOAD DATA INFILE '/tmp/tbl/partsupp.tbl' INTO TABLE partsupp FIELDS TERMINATED BY '|';
FLUSH TABLES;"""

TPCH_INDEX = """ALTER TABLE part ENABLE KEYS;
ALTER TABLE supplier ENABLE KEYS;
ALTER TABLE partsupp ENABLE KEYS;
FLUSH TABLES;"""

# TPC-H Q16, the specification's text with its validation parameters.
TPCH_Q16 = """select
	p_brand,
	p_type,
	p_size,
	count(distinct ps_suppkey) as supplier_cnt
from
	partsupp,
	part
where
	p_partkey = ps_partkey
	and p_brand <> 'Brand#45'
	and p_type not like 'MEDIUM POLISHED%'
	and p_size in (49, 14, 23, 45, 19, 3, 36, 9)
	and ps_suppkey not in (
		select
			s_suppkey
		from
			supplier
		where
			s_comment like '%Customer%Complaints%'
	)
group by
	p_brand,
	p_type,
	p_size
order by
	supplier_cnt desc,
	p_brand,
	p_type,
	p_size;"""

# Table rows high (like small files, below metadata), indexes lowest (Sky: "give the secondary
# index data a lower priority than all other I/O requests").
MARIADB_HINTS = "/mnt/db/tpch/*.MYD=4;/mnt/db/tpch/*.MYI=0"


def heredoc(path, text):
    return f"cat > {path} <<'VMSIGHT_EOF'\n{text}\nVMSIGHT_EOF\n"


def mariadb_prep_script(sf):
    """Once per invocation: mariadb-install-db on the template disk (vdb), the generator's .tbl
    files on the data disk (vdc)."""
    return ("set -e\nmount /dev/vdb /mnt; mkdir -p /data; mount /dev/vdc /data\n"
            + heredoc("/tmp/my.cnf", MARIADB_CNF) + heredoc("/tmp/dbgen.py", TPCH_DBGEN) + f"""
t0=$(date +%s.%N)
python3 /tmp/dbgen.py {sf} /data/tbl
t1=$(date +%s.%N)
mariadb-install-db --defaults-file=/tmp/my.cnf --auth-root-authentication-method=normal \\
    --skip-test-db >/tmp/install.log 2>&1 || {{ tail -n 30 /tmp/install.log; exit 1; }}
t2=$(date +%s.%N)
echo "tbl_bytes $(du -sb /data/tbl | cut -f1)"; echo "datadir_bytes $(du -sb /mnt/db | cut -f1)"
mariadbd --version
umount /data; umount /mnt
echo "T gen $t0 $t1"; echo "T install $t1 $t2"
""")


MARIADB_SCRIPT = ("set -e\nmount /dev/vdb /mnt; mkdir -p /data; mount -o ro /dev/vdc /data\n"
                  "cp -r /data/tbl /tmp/tbl; umount /data\n"
                  + heredoc("/tmp/my.cnf", MARIADB_CNF) + heredoc("/tmp/schema.sql", TPCH_SCHEMA)
                  + heredoc("/tmp/load.sql", TPCH_LOAD) + heredoc("/tmp/index.sql", TPCH_INDEX)
                  + heredoc("/tmp/q16.sql", TPCH_Q16) + f"""
M="mariadb --defaults-file=/tmp/my.cnf"
# mariadbd under the shim for its whole life: rows (.MYD) class 4, indexes (.MYI) class 0.
start() {{
    VMSIGHT_HINTS='{MARIADB_HINTS}' {PRELOAD} mariadbd --defaults-file=/tmp/my.cnf &
    MPID=$!
    n=0
    until $M -e 'select 1' >/dev/null 2>&1; do
        n=$((n + 1)); [ $n -lt 600 ] || {{ tail -n 30 /tmp/mysqld.err; exit 1; }}
        kill -0 $MPID 2>/dev/null || {{ tail -n 30 /tmp/mysqld.err; exit 1; }}
        sleep 0.2
    done
}}
stop() {{ $M -e shutdown; wait $MPID; }}
disabled() {{ $M tpch -N -e "show index from partsupp" | grep -c disabled || true; }}
start
$M < /tmp/schema.sql
sync
t0=$(date +%s.%N)
$M tpch < /tmp/load.sql
sync
t1=$(date +%s.%N)
rm -rf /tmp/tbl
[ "$(disabled)" -gt 0 ] || {{ echo "indexes were built during the load"; exit 1; }}
$M tpch < /tmp/index.sql
sync
t2=$(date +%s.%N)
[ "$(disabled)" -eq 0 ] || {{ echo "indexes still disabled after ENABLE KEYS"; exit 1; }}
(echo EXPLAIN; cat /tmp/q16.sql) | $M tpch | sed 's/^/PLAN\t/'
for f in /mnt/db/tpch/*.MY?; do echo "FILE $(basename $f) $(stat -c %s $f)"; done
stop
sync; echo 3 > /proc/sys/vm/drop_caches
start
t3=$(date +%s.%N)
$M tpch < /tmp/q16.sql > /tmp/q16.out
t4=$(date +%s.%N)
echo "q16 rows $(($(wc -l < /tmp/q16.out) - 1)) md5 $(md5sum < /tmp/q16.out | cut -c1-32)"
head -n 4 /tmp/q16.out | sed 's/^/Q16\t/'
stop
umount /mnt
echo "T load $t0 $t1"; echo "T index $t1 $t2"; echo "T query $t3 $t4"
""")


def insight_summary(path, disk=1):
    """Bytes of the disk's requests in the insight log by (op, file extension) and class, and
    how many of them carried an application hint: what the classifier handed the cache."""
    out = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("op") not in ("read", "write") or r.get("disk") != disk:
                continue
            f = r.get("file")
            ext = (os.path.splitext(f)[1] or "(no extension)") if f else "(no file)"
            d = out.setdefault(f"{r['op']} {ext}", {"bytes": 0, "hinted_bytes": 0, "by_class": {}})
            n = int(r.get("len", 0))
            d["bytes"] += n
            if r.get("app_class") is not None:
                d["hinted_bytes"] += n
            c = str(r.get("class"))
            d["by_class"][c] = d["by_class"].get(c, 0) + n
    return out


def describe_hints(summary, kinds=("write .MYD", "write .MYI")):
    parts = []
    for k in kinds:
        d = summary.get(k)
        if not d or not d["bytes"]:
            continue
        cls = ", ".join(f"c{c} {100 * b / d['bytes']:.0f}%"
                        for c, b in sorted(d["by_class"].items(), key=lambda kv: -kv[1])
                        if b >= 0.005 * d["bytes"])
        parts.append(f"{k} {d['bytes'] / 2**20:.1f} MiB ({cls}; hinted {100 * d['hinted_bytes'] / d['bytes']:.0f}%)")
    return "; ".join(parts) or "no requests on the data files"


def cache_classes(cache):
    """Blocks inserted and refused per class: the hints as the cache saw them."""
    if not cache:
        return "-"
    ins = ", ".join(f"c{c['class']} {c['inserted']}" for c in cache["classes"] if c.get("inserted"))
    na = ", ".join(f"c{c['class']} {c['not_admitted']}" for c in cache["classes"] if c.get("not_admitted"))
    return f"inserted {ins or 'none'}; not admitted {na or 'none'}"


def run(config, model, cache_mib, disks, script, summarize=False):
    with tempfile.TemporaryDirectory(prefix="bench-icache-") as work:
        st = os.path.join(work, "stats.json")
        args = [VMSIGHT, "run", "--stats-json", st, "--disk-model", model]
        for d in disks:
            args += ["--disk", d]
        if config != "nocache":
            args += ["--cache-size", str(cache_mib),
                     "--cache-policy", "priority" if config == "priority" else "lru"]
        if config in ("lru+insights", "priority"):
            args += ["--insights", os.path.join(work, "ins.jsonl")]
        args += ["--", "sh", "-c", script]
        t0 = time.monotonic()
        p = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        wall = time.monotonic() - t0
        if p.returncode != 0:
            sys.exit(f"{config}/{model} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        times = {}
        for line in p.stdout.splitlines():
            w = line.split()
            if len(w) == 4 and w[0] == "T":
                times[w[1]] = float(w[3]) - float(w[2])
        s = json.load(open(st))
        disk = s["disks"][1]
        return {"times": times, "wall": wall, "cache": disk.get("cache"),
                "model": (disk.get("model") or {}).get("model", "none"), "stdout": p.stdout,
                "insights": insight_summary(os.path.join(work, "ins.jsonl")) if summarize else None}


def hit_rates(cache):
    """Whole-run read hit rate, hits by the class of the cached block, misses.

    A read's class is only known after the disk returned its data (the classifier matches the
    content), so misses are counted in class 0; hits count under the cached block's class."""
    if not cache:
        return "-"
    hits, misses = cache["hits"], cache["misses"]
    if hits + misses == 0:
        return "no reads"
    by = ", ".join(f"c{c['class']} {c['hits']}" for c in cache["classes"] if c["hits"])
    return f"{100.0 * hits / (hits + misses):.0f}% of {hits + misses} blocks (hits: {by or 'none'})"


def prep_mariadb(tmp, sf):
    """Boots the prep guest (no cache, no disk model): template disk with an installed datadir,
    data disk with the generator's .tbl files. Returns (template, tbl, facts)."""
    template, tbl = os.path.join(tmp, "mariadb-template.img"), os.path.join(tmp, "tpch-tbl.img")
    ext4(template, 4096)
    ext4(tbl, max(256, int(sf * 200) + 64))
    t0 = time.monotonic()
    p = subprocess.run([VMSIGHT, "run", "--disk", template, "--disk", tbl, "--",
                        "sh", "-c", mariadb_prep_script(sf)],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"mariadb prep failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    facts = {"wall_s": time.monotonic() - t0}
    for line in p.stdout.splitlines():
        w = line.split()
        if len(w) == 4 and w[0] == "T":
            facts[f"{w[1]}_s"] = float(w[3]) - float(w[2])
        elif len(w) == 2 and w[0].endswith("_bytes"):
            facts[w[0]] = int(w[1])
        elif line.startswith("mariadbd"):
            facts["version"] = line.strip()
    return template, tbl, facts


def mariadb_facts(stdout):
    """What a mariadb run printed besides its phase times: file sizes, Q16's result, the plan."""
    f = {"data_bytes": 0, "index_bytes": 0, "files": {}, "plan": [], "q16_head": []}
    for line in stdout.splitlines():
        w = line.split()
        if line.startswith("PLAN\t"):
            f["plan"].append(line[5:])
        elif line.startswith("Q16\t"):
            f["q16_head"].append(line[4:])
        elif len(w) == 3 and w[0] == "FILE":
            f["files"][w[1]] = int(w[2])
            f["data_bytes" if w[1].endswith(".MYD") else "index_bytes"] += int(w[2])
        elif len(w) == 5 and w[:2] == ["q16", "rows"]:
            f["q16_rows"], f["q16_md5"] = int(w[2]), w[4]
    return f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=100000)
    ap.add_argument("--cache-mib", type=int, default=64)
    ap.add_argument("--rows", type=int, default=100000)
    ap.add_argument("--sf", type=float, default=0.35,
                    help="TPC-H scale factor of the mariadb workload (Sky: 1.7)")
    ap.add_argument("--only", default="find,sqlite,mariadb", help="workloads: find, sqlite, mariadb")
    ap.add_argument("--models", default="hdd,ssd")
    ap.add_argument("--configs", default="nocache,lru,lru+insights,priority")
    ap.add_argument("--reps", type=int, default=1, help="runs per configuration (median)")
    ap.add_argument("--verbose", action="store_true", help="print every run's cache counters")
    bench_results.add_out_option(ap, "icache")
    a = ap.parse_args()
    rec = bench_results.Recorder("icache", a, out=a.out, keys=["workload", "model", "config"],
                                 baseline="lru")
    speedups = {}
    configs = a.configs.split(",")
    print(f"# bench/icache.py --files {a.files} --cache-mib {a.cache_mib} --rows {a.rows} --sf {a.sf} --reps {a.reps}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} host CPUs")
    with tempfile.TemporaryDirectory(prefix="bench-icache-") as tmp:
        tar = os.path.join(tmp, "tree.tar")
        if "find" in a.only:
            total = make_tree_tar(tar, a.files)
            print(f"tree: {a.files} files, {total / 2**20:.0f} MiB of file data, tar {os.path.getsize(tar) / 2**20:.0f} MiB")
        prep, plan, q16 = {}, None, set()
        if "mariadb" in a.only:
            template, tbl, prep = prep_mariadb(tmp, a.sf)
            print(f"mariadb: {prep.get('version', '?')}; TPC-H sf {a.sf}: .tbl files "
                  f"{prep.get('tbl_bytes', 0) / 2**20:.0f} MiB generated in the guest in {prep.get('gen_s', 0):.0f} s, "
                  f"mariadb-install-db {prep.get('install_s', 0):.0f} s (prep guest, once)")
        for wl in a.only.split(","):
            for model in a.models.split(","):
                rows = {}
                runs = {c: [] for c in configs}
                # Repetitions interleave the configurations, so slow phases of a shared
                # machine spread over all of them.
                for rep in range(a.reps):
                    for config in configs:
                        img = os.path.join(tmp, "target.img")
                        extra = {}
                        if wl == "mariadb":
                            # Every run starts from the installed datadir (sparse copy).
                            subprocess.run(["cp", "--sparse=always", template, img], check=True)
                        else:
                            # Room for the tree's inodes (and twice its data) at any --files.
                            ext4(img, max(4096, 2 * os.path.getsize(tar) >> 20 if wl == "find" else 0),
                                 inodes=max(262144, a.files * 5 // 4 + 10000) if wl == "find" else None)
                        if wl == "find":
                            r = run(config, model, a.cache_mib, [img, tar + ",ro"], FIND_SCRIPT)
                            # The guest's own count of the unpacked files: all of them, or the run is void.
                            n = [int(w[1]) for w in map(str.split, r["stdout"].splitlines())
                                 if len(w) == 2 and w[0] == "files" and w[1].isdigit()]
                            if n != [a.files]:
                                sys.exit(f"{config}/{model}: the guest found {n} files, not {a.files}")
                            extra = dict(guest_files=n[0])
                        elif wl == "sqlite":
                            r = run(config, model, a.cache_mib, [img], sqlite_script(a.rows))
                        else:
                            r = run(config, model, a.cache_mib, [img, tbl + ",ro"], MARIADB_SCRIPT,
                                    summarize=config != "nocache")
                            db = r["db"] = mariadb_facts(r["stdout"])
                            q16.add((db.get("q16_rows"), db.get("q16_md5")))
                            if plan is None:
                                plan = db["plan"]
                                print("\nQ16 plan (EXPLAIN, first run):\n")
                                print("\n".join("    " + line for line in plan))
                                print(f"\nQ16: {db.get('q16_rows')} rows, first: "
                                      + " / ".join(db["q16_head"][1:3]))
                            classes = (r["cache"] or {}).get("classes", [])
                            extra = dict(db_data_bytes=db["data_bytes"], db_index_bytes=db["index_bytes"],
                                         db_files=db["files"], q16_rows=db.get("q16_rows"),
                                         q16_md5=db.get("q16_md5"), hints=r["insights"],
                                         cache_class_inserted={f"c{c['class']}": c.get("inserted") for c in classes},
                                         cache_class_not_admitted={f"c{c['class']}": c.get("not_admitted")
                                                                   for c in classes})
                        runs[config].append(r)
                        os.unlink(img)
                        cache = r["cache"] or {}
                        rec.rep(workload=wl, model=model, config=config, rep=rep,
                                **{f"{p}_s": t for p, t in r["times"].items()}, total_s=sum(r["times"].values()),
                                wall_s=r["wall"], cache_hits=cache.get("hits"), cache_misses=cache.get("misses"),
                                cache_class_hits={f"c{c['class']}": c["hits"] for c in cache.get("classes", [])},
                                cache=r["cache"], model_desc=r["model"], **extra)
                        print(f"  {wl}/{model}/{config}: {r['times']} wall {r['wall']:.0f}s", file=sys.stderr)
                        if a.verbose:
                            print(f"    cache: {json.dumps(r['cache'])}", file=sys.stderr)
                for config, rs in runs.items():
                    # Median per phase; the cache counters of the last run.
                    times = {p: statistics.median(r["times"][p] for r in rs) for p in rs[0]["times"]}
                    rows[config] = dict(rs[-1], times=times)
                phases = list(next(iter(rows.values()))["times"].keys())
                print(f"\n### {wl}, disk model {model}: {next(iter(rows.values()))['model']}")
                print(f"cache {a.cache_mib} MiB per disk where used; times in s (inside the guest), "
                      f"median of {a.reps}\n")
                print("| config | " + " | ".join(phases) + " | total | read hit rate by class |")
                print("|---|" + "---:|" * (len(phases) + 1) + "---|")
                for config, r in rows.items():
                    t = r["times"]
                    print(f"| {config} | " + " | ".join(f"{t[p]:.2f}" for p in phases)
                          + f" | {sum(t.values()):.2f} | {hit_rates(r['cache'])} |")
                if "lru" in rows and "priority" in rows:
                    lru, pri = rows["lru"]["times"], rows["priority"]["times"]
                    ratios = ", ".join(f"{p} {lru[p] / pri[p]:.2f}x" for p in phases if pri[p] > 0)
                    print(f"\nspeedup priority vs lru: {ratios}, total "
                          f"{sum(lru.values()) / sum(pri.values()):.2f}x")
                    speedups[f"{wl}/{model}"] = dict({p: lru[p] / pri[p] for p in phases if pri[p] > 0},
                                                     total=sum(lru.values()) / sum(pri.values()))
                if "lru" in rows and "lru+insights" in rows:
                    l0, l1 = rows["lru"]["times"], rows["lru+insights"]["times"]
                    ov = ", ".join(f"{p} {100 * (l1[p] / l0[p] - 1):+.0f}%" for p in phases if l0[p] > 0)
                    print(f"interception overhead (lru+insights vs lru): {ov}")
                if wl == "mariadb":
                    db = next(iter(rows.values()))["db"]
                    print(f"\ndatabase: rows (.MYD) {db['data_bytes'] / 2**20:.1f} MiB, secondary indexes "
                          f"(.MYI) {db['index_bytes'] / 2**20:.1f} MiB, together "
                          f"{(db['data_bytes'] + db['index_bytes']) / 2**20 / a.cache_mib:.1f}x the cache")
                    for config, r in rows.items():
                        if r["cache"]:
                            print(f"* {config}: cache {cache_classes(r['cache'])}")
                        if r.get("insights"):
                            print(f"  insight log: {describe_hints(r['insights'])}")
                sys.stdout.flush()
    summary = {"speedup_priority_vs_lru": speedups}
    if "mariadb" in a.only:
        summary.update(mariadb_prep=prep, mariadb_q16_plan=plan,
                       mariadb_q16_results=sorted(list(x) for x in q16))
    rec.write(summary=summary)
    if len(q16) > 1:
        sys.exit(f"Q16 gave different results in different runs: {sorted(q16)}")


if __name__ == "__main__":
    main()
