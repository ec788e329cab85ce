// A small MessagePack codec for the page's second transport (maps, arrays, strings, binary, numbers,
// booleans, nil): what the realtime frame protocol exchanges. Written from the format's specification.
"use strict";

const MsgPack = (() => {
  const utf8 = new TextEncoder();
  const fromUtf8 = new TextDecoder("utf-8", { fatal: true });

  function encode(value) {
    const out = [];
    const bytes = (arr) => { for (const b of arr) out.push(b); };
    const be = (n, width) => { for (let i = width - 1; i >= 0; i--) out.push(Math.floor(n / 2 ** (8 * i)) & 0xff); };
    const put = (v) => {
      if (v === null || v === undefined) out.push(0xc0);
      else if (v === true) out.push(0xc3);
      else if (v === false) out.push(0xc2);
      else if (typeof v === "number" && Number.isInteger(v) && Math.abs(v) < 2 ** 53) {
        if (v >= 0 && v < 128) out.push(v);
        else if (v < 0 && v >= -32) out.push(v & 0xff);
        else if (v >= 0) {
          if (v < 2 ** 8) { out.push(0xcc); be(v, 1); } else if (v < 2 ** 16) { out.push(0xcd); be(v, 2); }
          else if (v < 2 ** 32) { out.push(0xce); be(v, 4); } else { out.push(0xcf); be(v, 8); }
        } else {
          const big = BigInt.asUintN(64, BigInt(v));
          out.push(0xd3);
          for (let i = 7n; i >= 0n; i--) out.push(Number((big >> (8n * i)) & 0xffn));
        }
      } else if (typeof v === "number") {
        const view = new DataView(new ArrayBuffer(8));
        view.setFloat64(0, v);
        out.push(0xcb); bytes(new Uint8Array(view.buffer));
      } else if (typeof v === "string") {
        const s = utf8.encode(v);
        if (s.length < 32) out.push(0xa0 | s.length);
        else if (s.length < 2 ** 8) { out.push(0xd9); be(s.length, 1); }
        else if (s.length < 2 ** 16) { out.push(0xda); be(s.length, 2); } else { out.push(0xdb); be(s.length, 4); }
        bytes(s);
      } else if (v instanceof Uint8Array || v instanceof ArrayBuffer) {
        const b = v instanceof ArrayBuffer ? new Uint8Array(v) : v;
        if (b.length < 2 ** 8) { out.push(0xc4); be(b.length, 1); }
        else if (b.length < 2 ** 16) { out.push(0xc5); be(b.length, 2); } else { out.push(0xc6); be(b.length, 4); }
        bytes(b);
      } else if (Array.isArray(v)) {
        if (v.length < 16) out.push(0x90 | v.length);
        else if (v.length < 2 ** 16) { out.push(0xdc); be(v.length, 2); } else { out.push(0xdd); be(v.length, 4); }
        v.forEach(put);
      } else if (typeof v === "object") {
        const keys = Object.keys(v).filter((k) => v[k] !== undefined);
        if (keys.length < 16) out.push(0x80 | keys.length);
        else if (keys.length < 2 ** 16) { out.push(0xde); be(keys.length, 2); } else { out.push(0xdf); be(keys.length, 4); }
        for (const k of keys) { put(k); put(v[k]); }
      } else throw new TypeError(`cannot encode ${typeof v}`);
    };
    put(value);
    return new Uint8Array(out);
  }

  function decode(data) {
    const buf = data instanceof ArrayBuffer ? new Uint8Array(data) : data;
    const view = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
    let at = 0;
    const take = (n) => { if (at + n > buf.length) throw new RangeError("truncated MessagePack"); const s = at; at += n; return s; };
    const uint = (n) => {
      const s = take(n);
      return n === 1 ? view.getUint8(s) : n === 2 ? view.getUint16(s) : n === 4 ? view.getUint32(s)
        : Number(view.getBigUint64(s));
    };
    const int = (n) => {
      const s = take(n);
      return n === 1 ? view.getInt8(s) : n === 2 ? view.getInt16(s) : n === 4 ? view.getInt32(s)
        : Number(view.getBigInt64(s));
    };
    const str = (n) => { const s = take(n); return fromUtf8.decode(buf.subarray(s, s + n)); };
    const bin = (n) => { const s = take(n); return buf.slice(s, s + n); };
    const arr = (n) => { const a = []; for (let i = 0; i < n; i++) a.push(get()); return a; };
    const map = (n) => { const m = {}; for (let i = 0; i < n; i++) { const k = get(); m[k] = get(); } return m; };
    const get = () => {
      const t = uint(1);
      if (t < 0x80) return t;
      if (t < 0x90) return map(t & 0x0f);
      if (t < 0xa0) return arr(t & 0x0f);
      if (t < 0xc0) return str(t & 0x1f);
      if (t >= 0xe0) return t - 256;
      switch (t) {
        case 0xc0: return null;
        case 0xc2: return false;
        case 0xc3: return true;
        case 0xc4: return bin(uint(1));
        case 0xc5: return bin(uint(2));
        case 0xc6: return bin(uint(4));
        case 0xca: { const s = take(4); return view.getFloat32(s); }
        case 0xcb: { const s = take(8); return view.getFloat64(s); }
        case 0xcc: return uint(1);
        case 0xcd: return uint(2);
        case 0xce: return uint(4);
        case 0xcf: return uint(8);
        case 0xd0: return int(1);
        case 0xd1: return int(2);
        case 0xd2: return int(4);
        case 0xd3: return int(8);
        case 0xd9: return str(uint(1));
        case 0xda: return str(uint(2));
        case 0xdb: return str(uint(4));
        case 0xdc: return arr(uint(2));
        case 0xdd: return arr(uint(4));
        case 0xde: return map(uint(2));
        case 0xdf: return map(uint(4));
        default: throw new TypeError(`unsupported MessagePack type 0x${t.toString(16)}`);
      }
    };
    const value = get();
    if (at !== buf.length) throw new RangeError("trailing bytes after MessagePack value");
    return value;
  }

  return { encode, decode };
})();
window.MsgPack = MsgPack;
