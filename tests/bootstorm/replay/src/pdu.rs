//! The NVMe/TCP subset the replayer speaks (no digests): ICReq/ICResp, command capsules
//! (Fabrics Connect, Property Get/Set, Read), capsule responses and C2HData. Layouts as in
//! tests/chaos/nvme_tcp.py.

use std::io::{self, Read, Write};

pub const IC_REQ: u8 = 0x00;
pub const IC_RESP: u8 = 0x01;
pub const CAPSULE_CMD: u8 = 0x04;
pub const CAPSULE_RESP: u8 = 0x05;
pub const C2H_DATA: u8 = 0x07;
/// C2HData flag: the data's last PDU also completes the command (no response capsule).
pub const F_SUCCESS: u8 = 0x08;

const SGL_IN_CAPSULE: u8 = 0x01;
const SGL_TRANSPORT: u8 = 0x5A;
const PSDT_SGL: u8 = 0x40;
const OP_READ: u8 = 0x02;
const OP_FABRICS: u8 = 0x7F;
const FC_PROPERTY_SET: u8 = 0x00;
const FC_CONNECT: u8 = 0x01;
const FC_PROPERTY_GET: u8 = 0x04;
pub const REG_CC: u32 = 0x14;
pub const REG_CSTS: u32 = 0x1C;
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:6368616f-732d-7465-7374-000000000001";

/// A logical block of the namespaces (the overlays' block size).
pub const BLOCK: u64 = 512;

/// A 64-byte submission queue entry with the SGL descriptor set.
pub struct Sqe([u8; 64]);

impl Sqe {
    fn new(opcode: u8) -> Sqe {
        let mut s = [0u8; 64];
        s[0] = opcode;
        s[1] = PSDT_SGL;
        Sqe(s)
    }

    fn fabrics(fctype: u8) -> Sqe {
        let mut s = Sqe::new(OP_FABRICS);
        s.0[4] = fctype;
        s
    }

    fn put(&mut self, at: usize, bytes: &[u8]) {
        self.0[at..at + bytes.len()].copy_from_slice(bytes);
    }

    fn sgl(&mut self, len: u32, kind: u8) {
        self.put(24, &0u64.to_le_bytes());
        self.put(32, &len.to_le_bytes());
        self.0[39] = kind;
    }

    /// A Read of `len` bytes at byte `off` of namespace `nsid`.
    pub fn read(nsid: u32, off: u64, len: u32) -> Sqe {
        let mut s = Sqe::new(OP_READ);
        s.put(4, &nsid.to_le_bytes());
        s.put(40, &(off / BLOCK).to_le_bytes());
        s.put(48, &(len / BLOCK as u32 - 1).to_le_bytes());
        s.sgl(len, SGL_TRANSPORT);
        s
    }

    /// Fabrics Connect of queue `qid` (`sqsize` entries) to controller `cntlid`.
    pub fn connect(
        qid: u16,
        sqsize: u16,
        hostid: [u8; 16],
        cntlid: u16,
        nqn: &str,
    ) -> (Sqe, Vec<u8>) {
        let mut s = Sqe::fabrics(FC_CONNECT);
        s.put(42, &qid.to_le_bytes());
        s.put(44, &(sqsize - 1).to_le_bytes());
        let mut data = vec![0u8; 1024];
        data[..16].copy_from_slice(&hostid);
        data[16..18].copy_from_slice(&cntlid.to_le_bytes());
        data[256..256 + nqn.len()].copy_from_slice(nqn.as_bytes());
        data[512..512 + HOSTNQN.len()].copy_from_slice(HOSTNQN.as_bytes());
        s.sgl(data.len() as u32, SGL_IN_CAPSULE);
        (s, data)
    }

    /// Property Set of a 4-byte register.
    pub fn property_set(reg: u32, value: u64) -> Sqe {
        let mut s = Sqe::fabrics(FC_PROPERTY_SET);
        s.put(44, &reg.to_le_bytes());
        s.put(48, &value.to_le_bytes());
        s
    }

    /// Property Get of a 4-byte register.
    pub fn property_get(reg: u32) -> Sqe {
        let mut s = Sqe::fabrics(FC_PROPERTY_GET);
        s.put(44, &reg.to_le_bytes());
        s
    }

    /// The capsule command PDU of this entry with command id `cid` and in-capsule `data`,
    /// appended to `out`.
    pub fn capsule(mut self, cid: u16, data: &[u8], out: &mut Vec<u8>) {
        self.put(2, &cid.to_le_bytes());
        let pdo = if data.is_empty() { 0 } else { 72 };
        out.extend_from_slice(&[CAPSULE_CMD, 0, 72, pdo]);
        out.extend_from_slice(&(72 + data.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.0);
        out.extend_from_slice(data);
    }
}

/// The ICReq PDU (128 bytes).
pub fn ic_req() -> [u8; 128] {
    let mut p = [0u8; 128];
    p[0] = IC_REQ;
    p[2] = 128;
    p[4..8].copy_from_slice(&128u32.to_le_bytes());
    p
}

/// What one received PDU meant to the host.
pub enum Event {
    /// Command `cid` completed with `dw0` and status code `status` (0: success).
    Done { cid: u16, dw0: u32, status: u16 },
    /// Data of a command that a later PDU completes.
    Data,
    /// An ICResp.
    IcResp,
}

/// Reads one PDU from `r`, dropping any data into `scratch`.
pub fn recv(r: &mut impl Read, scratch: &mut [u8]) -> io::Result<Event> {
    let mut ch = [0u8; 8];
    r.read_exact(&mut ch)?;
    let (ptype, flags, hlen) = (ch[0], ch[1], ch[2] as usize);
    let plen = u32::from_le_bytes([ch[4], ch[5], ch[6], ch[7]]) as usize;
    if plen < 8 || hlen < 8 || hlen > plen {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad PDU header {ch:?}"),
        ));
    }
    let mut hdr = [0u8; 256];
    let hdr = hdr.get_mut(..hlen - 8).ok_or_else(|| bad(ptype))?;
    r.read_exact(hdr)?;
    let mut rest = plen - hlen;
    while rest > 0 {
        let n = rest.min(scratch.len());
        r.read_exact(&mut scratch[..n])?;
        rest -= n;
    }
    match ptype {
        C2H_DATA if flags & F_SUCCESS != 0 => Ok(Event::Done {
            cid: u16::from_le_bytes([hdr[0], hdr[1]]),
            dw0: 0,
            status: 0,
        }),
        C2H_DATA => Ok(Event::Data),
        CAPSULE_RESP if hdr.len() >= 16 => Ok(Event::Done {
            cid: u16::from_le_bytes([hdr[12], hdr[13]]),
            dw0: u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]),
            status: u16::from_le_bytes([hdr[14], hdr[15]]) >> 1,
        }),
        IC_RESP => Ok(Event::IcResp),
        _ => Err(bad(ptype)),
    }
}

fn bad(ptype: u8) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("unexpected PDU type {ptype:#x}"),
    )
}

/// Sends `buf` whole and empties it.
pub fn send(w: &mut impl Write, buf: &mut Vec<u8>) -> io::Result<()> {
    w.write_all(buf)?;
    buf.clear();
    Ok(())
}
