"""Natural-looking English and Chinese text from a small built-in grammar, deterministic per seed.

Benchmarks and synthetic eval tasks need long, varied prose: sparse top-k block selection and
speculative-decoding acceptance both depend on content, so one repeated token would measure the
wrong thing. Everything is generated locally (no downloads, no stdlib docstrings, whose text
changes between Python versions) from `random.Random(seed)`, whose sequences are stable across
Python versions, so the same seed gives the same text on every machine.
"""

from __future__ import annotations

import random

# ----------------------------------------------------------------------------- English lexicon

_EN_NOUNS = (
    "river bridge village market engineer teacher farmer library garden harbor mountain valley "
    "forest island museum journal report budget council committee station railway factory "
    "hospital school student doctor painter musician writer sailor merchant captain mayor "
    "scientist architect lawyer pilot baker neighbor traveler stranger family company project "
    "system network machine engine signal pattern question answer problem method theory model "
    "experiment measurement sample record archive letter message window door kitchen table "
    "lantern candle mirror clock compass map ladder wall tower castle cathedral chapel cottage "
    "meadow orchard vineyard harvest winter summer autumn spring morning evening storm breeze "
    "cloud shadow light voice song story poem novel chapter painting sculpture festival concert "
    "league match season contract treaty policy reform election debate argument decision plan "
    "strategy journey voyage expedition discovery invention device tool instrument battery "
    "circuit sensor camera telescope microscope satellite rocket planet comet glacier desert "
    "canyon volcano lake ocean coast beach cliff path road highway tunnel canal dam reservoir "
    "well pump pipe valve furnace oven bakery workshop studio office warehouse shipment cargo "
    "vessel crew passenger ticket schedule platform border province county district region"
).split()

_EN_ADJS = (
    "quiet ancient modern narrow broad bright dark gentle careful curious patient eager honest "
    "famous forgotten hidden distant nearby remote crowded empty busy lazy rapid slow steady "
    "fragile sturdy heavy light warm cold humid dry golden silver wooden stone iron copper "
    "colorful pale vivid subtle obvious strange familiar rare common simple complex elegant "
    "rough smooth sharp dull noisy silent clever foolish brave timid generous modest proud "
    "humble wealthy poor fertile barren northern southern eastern western coastal rural urban "
    "local foreign official private public secret early late recent former future temporary "
    "permanent essential optional reliable uncertain accurate rough detailed brief lengthy"
).split()

_EN_VERBS = (
    ("examine", "examined"), ("describe", "described"), ("build", "built"), ("repair", "repaired"),
    ("visit", "visited"), ("study", "studied"), ("design", "designed"), ("measure", "measured"),
    ("collect", "collected"), ("discover", "discovered"), ("publish", "published"),
    ("improve", "improved"), ("replace", "replaced"), ("inspect", "inspected"),
    ("protect", "protected"), ("organize", "organized"), ("support", "supported"),
    ("question", "questioned"), ("approve", "approved"), ("reject", "rejected"),
    ("paint", "painted"), ("carry", "carried"), ("follow", "followed"), ("explore", "explored"),
    ("observe", "observed"), ("record", "recorded"), ("translate", "translated"),
    ("finish", "finished"), ("delay", "delayed"), ("announce", "announced"),
    ("review", "reviewed"), ("test", "tested"), ("defend", "defended"), ("share", "shared"),
    ("sell", "sold"), ("find", "found"), ("write", "wrote"), ("draw", "drew"), ("see", "saw"),
    ("keep", "kept"), ("leave", "left"), ("bring", "brought"), ("teach", "taught"),
    ("choose", "chose"), ("move", "moved"), ("open", "opened"), ("close", "closed"),
    ("restore", "restored"), ("map", "mapped"), ("plan", "planned"), ("clean", "cleaned"),
)

_EN_REPORT_VERBS = ("reported", "noted", "argued", "suggested", "claimed", "explained",
                    "concluded", "observed", "believed", "wrote", "admitted", "insisted")

_EN_ADVS = ("Eventually", "Meanwhile", "Surprisingly", "Later", "At first", "Fortunately",
            "Unfortunately", "In the end", "For a while", "Soon afterwards", "Once again",
            "Quietly", "Without warning", "In practice", "By contrast", "As expected")

_EN_TIMES = ("last winter", "in the spring", "before dawn", "after the storm", "that evening",
             "during the festival", "within a week", "over the following years", "at noon",
             "in the late autumn", "the next morning", "for several months", "in recent years",
             "after a long delay", "before the election", "at the end of the season")

_EN_PREPS = ("near", "behind", "beside", "across", "inside", "beyond", "along", "under", "above",
             "around", "toward", "outside")

_EN_FIRST = ("Anna Liam Sofia Noah Elena Marcus Clara Victor Maya Oscar Irene Felix Helena "
             "Tomas Lucia Daniel Nora Henry Alice Samuel Grace Julian Ruth Arthur Vera Simon "
             "Ada Leon Iris Edgar").split()
_EN_LAST = ("Walker Moreau Lindqvist Okafor Brennan Castillo Novak Whitford Hale Sato Ferreira "
            "Kowalski Adler Marsh Delacroix Holt Varga Quinn Ashby Tanaka Mercer Reyes Lund "
            "Barrow Sinclair Petrov Ellery Crane Dubois Harlan").split()

_EN_PLACES = ("Aldermoor", "Brightwater", "Calder Falls", "Dunmore", "Eastbrook", "Fairhaven",
              "Glenrock", "Harrowgate", "Ivywood", "Kestrel Bay", "Larkspur", "Millbrook",
              "Northcliff", "Oakridge", "Pinehurst", "Queensford", "Ravenhill", "Stonebridge",
              "Thornbury", "Westmere", "Yarrow Point")


def _plural(noun: str) -> str:
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    return noun + "s"


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


# ----------------------------------------------------------------------------- Chinese lexicon

_ZH_NOUNS = (
    "城市 乡村 河流 山谷 森林 湖泊 港口 铁路 工厂 医院 学校 图书馆 博物馆 市场 公园 花园 农田 "
    "工程师 教师 农民 医生 学生 作家 画家 音乐家 商人 船长 市长 科学家 建筑师 律师 司机 邻居 "
    "旅行者 家庭 公司 项目 系统 网络 机器 信号 模型 方法 理论 实验 数据 样本 记录 档案 信件 "
    "报告 预算 委员会 政策 改革 计划 策略 旅程 发现 发明 设备 工具 仪器 电池 电路 传感器 "
    "相机 望远镜 卫星 火箭 行星 冰川 沙漠 峡谷 火山 海岸 道路 隧道 运河 水库 仓库 货物 "
    "乘客 车票 时刻表 站台 边境 省份 地区 社区 文化 历史 传统 节日 音乐会 比赛 赛季 合同 "
    "技术 经济 市场 产业 教育 环境 气候 能源 交通 农业 资源 人口 文学 艺术 哲学 语言"
).split()

_ZH_ADJS = (
    "古老 现代 狭窄 宽阔 明亮 安静 热闹 遥远 附近 偏僻 拥挤 空旷 缓慢 迅速 稳定 脆弱 坚固 "
    "沉重 温暖 寒冷 潮湿 干燥 复杂 简单 精致 粗糙 清晰 模糊 常见 罕见 重要 普通 新颖 传统 "
    "可靠 准确 详细 简短 漫长 丰富 独特 公开 秘密 早期 近期 未来 临时 长期"
).split()

_ZH_VERBS = (
    "研究了 描述了 建造了 修复了 访问了 设计了 测量了 收集了 发现了 发表了 改进了 替换了 "
    "检查了 保护了 组织了 支持了 批准了 拒绝了 记录了 翻译了 完成了 推迟了 宣布了 审查了 "
    "测试了 分享了 出售了 整理了 探索了 观察了 讨论了 提出了 分析了 总结了 比较了 评估了"
).split()

_ZH_VERBS_BASE = (
    "研究 保护 改进 重新评估 继续推进 认真对待 逐步完善 公开讨论 深入分析 尽快完成 "
    "重新设计 加强管理 扩大规模 降低成本"
).split()

_ZH_TIMES = ("去年冬天", "今年春天", "上个月", "近几年来", "在过去的十年里", "当天晚上",
             "第二天清晨", "节日期间", "暴雨过后", "选举之前", "几个星期以来", "不久之后",
             "同一时期", "那年秋天", "清晨时分", "一个世纪以前")

_ZH_DEADLINES = ("月底", "年底", "下周", "雨季到来", "冬天", "选举", "节日", "明年春天")

_ZH_CONNECT = ("因此", "然而", "与此同时", "此外", "事实上", "换句话说", "总的来说", "相比之下",
               "不过", "随后", "结果", "尽管如此")

_ZH_SURNAMES = "王李张刘陈杨赵黄周吴徐孙胡朱高林何郭马罗梁宋郑谢韩唐冯于董萧程曹袁邓许傅沈曾彭吕"
_ZH_GIVEN = "伟芳娜敏静丽强磊军洋勇艳杰娟涛明超秀霞平刚桂英华玉兰文辉建国志红梅春晓云海燕鹏飞宇"
_ZH_PLACES = ("青石镇 白沙湾 临江市 北岭村 南湖县 东山区 西河镇 金川市 云台乡 翠屏山 长风岛 "
              "落霞湾 石门关 清泉镇 松林堡").split()
_ZH_ORGS = ("研究所 委员会 博物馆 出版社 实验室 协会 合作社 基金会 学院 设计院").split()
_ZH_DIRS = ("东部", "西部", "南部", "北部", "中部", "东南部", "西北部", "沿海地区")

_ZH_DIGITS = "零一二三四五六七八九"


class TextGen:
    """Sentence and paragraph generator; all randomness comes from one seeded `random.Random`."""

    def __init__(self, seed: int | str) -> None:
        self.rng = random.Random(seed)

    # ---- English

    def _en_person(self) -> str:
        return f"{self.rng.choice(_EN_FIRST)} {self.rng.choice(_EN_LAST)}"

    def _en_np(self) -> str:
        r = self.rng
        noun = r.choice(_EN_NOUNS)
        if r.random() < 0.5:
            return f"the {r.choice(_EN_ADJS)} {noun}"
        return f"the {noun}"

    def en_sentence(self) -> str:
        r = self.rng
        k = r.randrange(14)
        n1, n2 = r.choice(_EN_NOUNS), r.choice(_EN_NOUNS)
        a1, a2 = r.choice(_EN_ADJS), r.choice(_EN_ADJS)
        base, past = r.choice(_EN_VERBS)
        base2, past2 = r.choice(_EN_VERBS)
        place = r.choice(_EN_PLACES)
        if k == 0:
            s = f"the {a1} {n1} {past} the {n2} {r.choice(_EN_PREPS)} the {r.choice(_EN_NOUNS)}"
        elif k == 1:
            s = f"{self._en_person()} {past} {_article(a1)} {a1} {n1} {r.choice(_EN_TIMES)}"
        elif k == 2:
            s = f"in {r.randrange(1780, 2025)}, the {n1} of {place} {past} {self._en_np()}"
        elif k == 3:
            s = (f"{r.choice(_EN_ADVS)}, the {n1} {past} {_article(a2)} {a2} {n2}, and "
                 f"{self._en_np()} {past2} {r.choice(_EN_TIMES)}")
        elif k == 4:
            s = (f"although the {n1} was {a1}, {self._en_person()} {past} the {n2} "
                 f"{r.choice(_EN_PREPS)} {place}")
        elif k == 5:
            s = (f"researchers at {place} {r.choice(_EN_REPORT_VERBS)} that {self._en_np()} "
                 f"{past} the {n2} {r.choice(_EN_TIMES)}")
        elif k == 6:
            s = f"why did the {n1} {base} the {a2} {n2} {r.choice(_EN_TIMES)}?"
        elif k == 7:
            s = (f'{self._en_person()} said, "We will {base} the {n1} before the {a2} {n2} '
                 f'{past2} {r.choice(_EN_PREPS)} {place}."')
        elif k == 8:
            s = (f"there were {r.randrange(2, 90)} {_plural(n1)} {r.choice(_EN_PREPS)} the "
                 f"{a2} {n2} {r.choice(_EN_TIMES)}")
        elif k == 9:
            s = (f"the {n1} {past} about {r.randrange(3, 98)} percent of the {_plural(n2)} "
                 f"in {place}")
        elif k == 10:
            s = (f"few people expected the {n1} to {base} the {n2}, but {self._en_person()} "
                 f"{r.choice(_EN_REPORT_VERBS)} that it was {a1}")
        elif k == 11:
            s = (f"the {n1} and the {n2} were {a1} and {a2}, so {self._en_np()} {past2} "
                 f"them {r.choice(_EN_TIMES)}")
        elif k == 12:
            s = (f"according to the {a1} {r.choice(('report', 'archive', 'journal', 'letter'))}, "
                 f"{self._en_person()} {past} {self._en_np()} in {place}")
        else:
            s = f"if the {n1} {past} the {n2}, the {a1} {r.choice(_EN_NOUNS)} would {base2} it"
        s = s[0].upper() + s[1:]
        return s if s.endswith(("?", '."')) else s + "."

    # ---- Chinese

    def _zh_person(self) -> str:
        r = self.rng
        given = r.choice(_ZH_GIVEN) + (r.choice(_ZH_GIVEN) if r.random() < 0.6 else "")
        return r.choice(_ZH_SURNAMES) + given

    def _zh_np(self) -> str:
        r = self.rng
        if r.random() < 0.5:
            return f"{r.choice(_ZH_ADJS)}的{r.choice(_ZH_NOUNS)}"
        return r.choice(_ZH_NOUNS)

    @staticmethod
    def zh_number(n: int) -> str:
        """Chinese numerals for 1..99 (十三, 二十五)."""
        tens, ones = divmod(n, 10)
        head = "" if tens == 0 else ("十" if tens == 1 else _ZH_DIGITS[tens] + "十")
        return head + (_ZH_DIGITS[ones] if ones or not head else "")

    def zh_sentence(self) -> str:
        r = self.rng
        k = r.randrange(12)
        place = r.choice(_ZH_PLACES)
        if k == 0:
            return f"{r.choice(_ZH_TIMES)}，{self._zh_person()}{r.choice(_ZH_VERBS)}{self._zh_np()}。"
        if k == 1:
            return (f"{self._zh_person()}认为，{place}的{r.choice(_ZH_NOUNS)}应当"
                    f"{r.choice(_ZH_VERBS_BASE)}，{r.choice(_ZH_CONNECT)}{self._zh_np()}也会随之改变。")
        if k == 2:
            return (f"据{place}{r.choice(_ZH_ORGS)}统计，当地的{r.choice(_ZH_NOUNS)}在"
                    f"{r.randrange(1950, 2025)}年增长了百分之{r.randrange(2, 96)}。")
        if k == 3:
            return (f"虽然{r.choice(_ZH_NOUNS)}十分{r.choice(_ZH_ADJS)}，但是{self._zh_person()}"
                    f"仍然{r.choice(_ZH_VERBS)}{self._zh_np()}。")
        if k == 4:
            return (f"{place}位于{r.choice(_ZH_DIRS)}，那里的{r.choice(_ZH_NOUNS)}"
                    f"{r.choice(_ZH_ADJS)}而{r.choice(_ZH_ADJS)}。")
        if k == 5:
            return (f"{r.choice(_ZH_CONNECT)}，{self._zh_np()}与{self._zh_np()}之间的关系"
                    f"比人们想象的更加{r.choice(_ZH_ADJS)}。")
        if k == 6:
            return f"为什么{self._zh_person()}在{r.choice(_ZH_TIMES)}{r.choice(_ZH_VERBS)}{self._zh_np()}？"
        if k == 7:
            return (f"{self._zh_person()}说：“我们必须在{r.choice(_ZH_DEADLINES)}之前"
                    f"{r.choice(_ZH_VERBS_BASE)}这个{r.choice(_ZH_NOUNS)}。”")
        if k == 8:
            return (f"{place}一共有{r.randrange(2, 300)}个{r.choice(_ZH_NOUNS)}，其中大约"
                    f"{r.randrange(2, 60)}个已经{r.choice(_ZH_VERBS)}新的{r.choice(_ZH_NOUNS)}。")
        if k == 9:
            return (f"在{place}{r.choice(_ZH_ORGS)}的支持下，{self._zh_person()}{r.choice(_ZH_VERBS)}"
                    f"{self._zh_np()}，{r.choice(_ZH_CONNECT)}取得了{r.choice(_ZH_ADJS)}的成果。")
        if k == 10:
            return (f"关于{self._zh_np()}的讨论持续了{self.zh_number(r.randrange(2, 30))}个月，"
                    f"最终{r.choice(_ZH_ORGS)}{r.choice(_ZH_VERBS)}相关的{r.choice(_ZH_NOUNS)}。")
        return (f"如果{r.choice(_ZH_NOUNS)}继续保持{r.choice(_ZH_ADJS)}，{place}的"
                f"{r.choice(_ZH_NOUNS)}将会变得更加{r.choice(_ZH_ADJS)}。")

    # ---- mixed

    def sentence(self, lang: str) -> str:
        return self.en_sentence() if lang == "en" else self.zh_sentence()

    def paragraph(self, lang: str, n_sentences: int) -> str:
        sep = " " if lang == "en" else ""
        return sep.join(self.sentence(lang) for _ in range(n_sentences))

    def title(self, lang: str) -> str:
        r = self.rng
        if lang == "en":
            return f"The {r.choice(_EN_ADJS).title()} {r.choice(_EN_NOUNS).title()} of {r.choice(_EN_PLACES)}"
        return f"{r.choice(_ZH_PLACES)}{r.choice(_ZH_ADJS)}{r.choice(_ZH_NOUNS)}的{r.choice(_ZH_NOUNS)}"


# ----------------------------------------------------------------------------- invented names

_SYL_ONSET = ("b bl br c ch cl cr d dr f fl fr g gl gr h j k l m n p pl pr qu r s sh sk sl sn "
              "sp st t th tr v w z").split()
_SYL_VOWEL = ("a e i o u ai au ea ee ie oa oo ou").split()
_SYL_CODA = ("", "", "n", "r", "l", "m", "st", "nd", "rk", "th", "x", "ck", "mp", "sh")

# Common characters that make plausible two-character invented words.
_ZH_WORD_CHARS = ("山水田林石云风雨花草木竹松梅兰菊星月光明清远长青白红金银玉珠宝安宁平和"
                  "春秋冬夏东西南北江河湖海天地文华德信仁义礼智勇刚柔新古真善美乐歌舞书画")


# Every word the grammar can emit, to keep invented answer words out of generated prose.
_LEXICON_TEXT = " ".join(
    list(_EN_NOUNS) + list(_EN_ADJS) + [w for pair in _EN_VERBS for w in pair]
    + list(_EN_REPORT_VERBS) + list(_EN_ADVS) + list(_EN_TIMES) + list(_EN_PREPS)
    + list(_EN_FIRST) + list(_EN_LAST) + list(_EN_PLACES) + list(_ZH_NOUNS) + list(_ZH_ADJS)
    + list(_ZH_VERBS) + list(_ZH_VERBS_BASE) + list(_ZH_TIMES) + list(_ZH_DEADLINES)
    + list(_ZH_CONNECT) + list(_ZH_PLACES) + list(_ZH_ORGS) + list(_ZH_DIRS)).lower()


def in_lexicon(word: str) -> bool:
    """True if `word` occurs inside any word or phrase of the built-in grammar."""
    return word.lower() in _LEXICON_TEXT


def pseudo_word(rng: random.Random, lang: str) -> str:
    """An invented word: pronounceable Latin syllables for `en`, two or three CJK chars for `zh`."""
    if lang == "zh":
        n = 2 if rng.random() < 0.7 else 3
        return "".join(rng.choice(_ZH_WORD_CHARS) for _ in range(n))
    n = rng.choice((2, 2, 3))
    return "".join(rng.choice(_SYL_ONSET) + rng.choice(_SYL_VOWEL) + rng.choice(_SYL_CODA)
                   for _ in range(n))


def distinct_words(rng: random.Random, lang: str, n: int, avoid: set[str] | None = None) -> list[str]:
    """`n` distinct invented words, none equal to a word in `avoid`, in generation order."""
    seen = set(avoid or ())
    out: list[str] = []
    while len(out) < n:
        w = pseudo_word(rng, lang)
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out
