//! Replays a boot read trace on N namespaces of one NVMe-oF/TCP subsystem at once, as
//! tests/bootstorm/replay.py does but compiled, so that the host is not the floor of the
//! boot storm benchmark (tests/bootstorm_bench.sh). One controller per boot (an admin queue
//! and one I/O queue, as a VM's initiator would have), each boot on its own thread reading
//! namespace i + 1 in the trace's order with QD reads in flight; reads larger than 128 KiB
//! (SPDK's NVMe/TCP default max_io_size) are split. Every byte is received and dropped.
//!
//! Prints one JSON line: wall seconds from the common start to the last boot's end, each
//! boot's seconds, the bytes read, and this process's CPU seconds for the replay.
//!
//!     bootstorm_replay --port 4420 --nqn NQN --boots 8 --qd 8 --trace boot_trace.csv

mod pdu;

use std::io::{self, BufReader};
use std::net::TcpStream;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use pdu::{Event, Sqe, BLOCK};

/// SPDK's NVMe/TCP default max_io_size: larger reads are split.
const MAX_IO: u64 = 128 << 10;
/// Command ids per queue (the target's queues are far shallower).
const CIDS: usize = 1024;

/// One NVMe/TCP connection: a buffered reader, the socket to write, a send buffer.
struct Queue {
    rx: BufReader<TcpStream>,
    tx: TcpStream,
    out: Vec<u8>,
    scratch: Vec<u8>,
}

impl Queue {
    fn open(addr: &str, port: u16) -> io::Result<Queue> {
        let s = TcpStream::connect((addr, port))?;
        s.set_nodelay(true)?;
        let mut q = Queue {
            rx: BufReader::with_capacity(256 << 10, s.try_clone()?),
            tx: s,
            out: Vec::with_capacity(4096),
            scratch: vec![0u8; 256 << 10],
        };
        q.out.extend_from_slice(&pdu::ic_req());
        pdu::send(&mut q.tx, &mut q.out)?;
        match pdu::recv(&mut q.rx, &mut q.scratch)? {
            Event::IcResp => Ok(q),
            _ => Err(io::Error::other("expected ICResp")),
        }
    }

    /// One command at a time (setup): its dw0.
    fn command(&mut self, sqe: Sqe, data: &[u8]) -> io::Result<u32> {
        sqe.capsule(1, data, &mut self.out);
        pdu::send(&mut self.tx, &mut self.out)?;
        loop {
            if let Event::Done { dw0, status, .. } = pdu::recv(&mut self.rx, &mut self.scratch)? {
                if status != 0 {
                    return Err(io::Error::other(format!("status {status:#x}")));
                }
                return Ok(dw0);
            }
        }
    }
}

/// An enabled controller's (admin queue, I/O queue).
fn controller(a: &Args, boot: usize) -> io::Result<(Queue, Queue)> {
    let mut hostid = [0u8; 16];
    hostid[..8].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
    hostid[8..].copy_from_slice(&(boot as u64).to_le_bytes());
    let mut admin = Queue::open(&a.addr, a.port)?;
    let (sqe, data) = Sqe::connect(0, 32, hostid, 0xFFFF, &a.nqn);
    let cntlid = (admin.command(sqe, &data)? & 0xFFFF) as u16;
    admin.command(
        Sqe::property_set(pdu::REG_CC, (4 << 20) | (6 << 16) | 1),
        &[],
    )?;
    let mut ready = false;
    for _ in 0..1000 {
        if admin.command(Sqe::property_get(pdu::REG_CSTS), &[])? & 1 != 0 {
            ready = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    if !ready {
        return Err(io::Error::other("CSTS.RDY never set"));
    }
    let mut io = Queue::open(&a.addr, a.port)?;
    let (sqe, data) = Sqe::connect(1, (a.qd * 2).max(32) as u16, hostid, cntlid, &a.nqn);
    io.command(sqe, &data)?;
    Ok((admin, io))
}

/// Replays `trace` on namespace `nsid` of `q`, `qd` trace reads in flight.
fn boot(q: &mut Queue, nsid: u32, trace: &[(u64, u64)], qd: usize) -> io::Result<()> {
    let mut free: Vec<u16> = (1..CIDS as u16).rev().collect();
    // For each command id, the trace read it is part of; for each trace read, its parts left.
    let mut owner = vec![0usize; CIDS];
    let mut left = vec![0u32; trace.len()];
    let (mut next, mut in_flight) = (0, 0);
    loop {
        while in_flight < qd && next < trace.len() {
            let (off, len) = trace[next];
            let mut o = off;
            while o < off + len {
                let n = MAX_IO.min(off + len - o);
                let cid = free
                    .pop()
                    .ok_or_else(|| io::Error::other("out of command ids"))?;
                owner[cid as usize] = next;
                left[next] += 1;
                Sqe::read(nsid, o, n as u32).capsule(cid, &[], &mut q.out);
                o += n;
            }
            next += 1;
            in_flight += 1;
        }
        if !q.out.is_empty() {
            pdu::send(&mut q.tx, &mut q.out)?;
        }
        if in_flight == 0 {
            return Ok(());
        }
        if let Event::Done { cid, status, .. } = pdu::recv(&mut q.rx, &mut q.scratch)? {
            if status != 0 {
                return Err(io::Error::other(format!("read status {status:#x}")));
            }
            let r = *owner
                .get(cid as usize)
                .ok_or_else(|| io::Error::other("bad cid"))?;
            free.push(cid);
            left[r] -= 1;
            if left[r] == 0 {
                in_flight -= 1;
            }
        }
    }
}

/// The trace's (offset, length) reads in whole blocks.
fn load(path: &str) -> io::Result<Vec<(u64, u64)>> {
    let text = std::fs::read_to_string(path)?;
    let mut trace = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut f = line.split(',').map(|x| x.trim().parse::<u64>());
        match (f.next(), f.next()) {
            (Some(Ok(off)), Some(Ok(len))) if len > 0 => {
                trace.push((off - off % BLOCK, len.div_ceil(BLOCK) * BLOCK))
            }
            _ => return Err(io::Error::other(format!("bad trace line {line:?}"))),
        }
    }
    Ok(trace)
}

/// This process's user + system CPU seconds (all threads), from /proc/self/stat.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name, which may hold spaces: utime, stime are 14 and 15.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    // Linux reports both in USER_HZ, 100 on every architecture's ABI.
    (ticks(11) + ticks(12)) / 100.0
}

struct Args {
    addr: String,
    port: u16,
    nqn: String,
    boots: usize,
    qd: usize,
    trace: String,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        addr: "127.0.0.1".into(),
        port: 0,
        nqn: String::new(),
        boots: 0,
        qd: 8,
        trace: String::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().ok_or(format!("{k} needs a value"))?;
        let num = |v: &str| v.parse::<usize>().map_err(|e| format!("{k}: {e}"));
        match k.as_str() {
            "--addr" => a.addr = v,
            "--port" => a.port = num(&v)? as u16,
            "--nqn" => a.nqn = v,
            "--boots" => a.boots = num(&v)?,
            "--qd" => a.qd = num(&v)?,
            "--trace" => a.trace = v,
            _ => return Err(format!("unknown option {k}")),
        }
    }
    if a.port == 0 || a.nqn.is_empty() || a.boots == 0 || a.qd == 0 || a.trace.is_empty() {
        return Err(
            "usage: bootstorm_replay --port P --nqn NQN --boots N [--qd 8] --trace CSV [--addr A]"
                .into(),
        );
    }
    Ok(a)
}

fn run(a: Args) -> io::Result<String> {
    let trace = Arc::new(load(&a.trace)?);
    let a = Arc::new(a);
    let mut queues = Vec::new();
    for i in 0..a.boots {
        queues.push(controller(&a, i)?);
    }
    let go = Arc::new(Barrier::new(a.boots + 1));
    let threads: Vec<_> = queues
        .into_iter()
        .enumerate()
        .map(|(i, (admin, mut io))| {
            let (go, trace, qd) = (go.clone(), trace.clone(), a.qd);
            std::thread::spawn(move || -> io::Result<Instant> {
                go.wait();
                boot(&mut io, i as u32 + 1, &trace, qd)?;
                let end = Instant::now();
                drop(admin);
                Ok(end)
            })
        })
        .collect();
    let cpu0 = cpu_seconds();
    go.wait();
    let start = Instant::now();
    let mut boots = Vec::new();
    for t in threads {
        let end = t
            .join()
            .map_err(|_| io::Error::other("a boot panicked"))??;
        boots.push(format!("{:.4}", end.duration_since(start).as_secs_f64()));
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let bytes: u64 = trace.iter().map(|&(_, n)| n).sum::<u64>() * a.boots as u64;
    Ok(format!(
        "{{\"wall\": {wall:.4}, \"boots\": [{}], \"bytes\": {bytes}, \"cpu\": {cpu:.3}}}",
        boots.join(", ")
    ))
}

fn main() {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    match run(a) {
        Ok(line) => println!("{line}"),
        Err(e) => {
            eprintln!("replay failed: {e}");
            std::process::exit(1);
        }
    }
}
